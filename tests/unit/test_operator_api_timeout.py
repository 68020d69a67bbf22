"""The operator's Kubernetes API client bounds every request (issue 23): the client
waits for ever by default, so one hung connection to the API server held a handler's
thread, and with it every later round of that storage. A real listener on loopback
takes the connection (the kernel does) and answers nothing, as a hung API server."""

from __future__ import annotations

import threading
import time

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from stratamq.operator.kube import BoundedApiClient, transient
from tests.support.sockets import hung_listener


def test_a_hung_api_server_fails_the_call_instead_of_blocking_it() -> None:
    outcome: list[BaseException | None] = []

    def discover(host: str) -> None:
        configuration = client.Configuration(host=host)
        try:
            DynamicClient(BoundedApiClient(configuration, timeout=(0.5, 0.5)))  # type: ignore[no-untyped-call]
            outcome.append(None)
        except BaseException as error:  # what the call ended with, whatever it was
            outcome.append(error)

    with hung_listener() as host:
        started = time.monotonic()
        caller = threading.Thread(target=discover, args=(host,), daemon=True)
        caller.start()
        caller.join(timeout=20)
        took = time.monotonic() - started
    assert outcome, "the call to a hung API server never returned"
    assert isinstance(outcome[0], urllib3.exceptions.HTTPError), outcome
    assert took < 10, took


def test_only_no_answer_or_try_later_is_tried_again() -> None:
    no_answer = urllib3.exceptions.ReadTimeoutError(None, "/version", "read timed out")  # type: ignore[arg-type]
    assert transient(no_answer) and transient(ConnectionResetError())
    for status in (429, 500, 502, 503, 504):
        assert transient(ApiException(status=status)), status
    # a refusal, a conflict, a missing object: the same call gets the same answer
    for status in (400, 401, 403, 404, 409, 422):
        assert not transient(ApiException(status=status)), status
