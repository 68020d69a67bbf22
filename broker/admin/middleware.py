"""What every stratamq HTTP API shares (the site's admin API, the cluster
controller's): JSON errors `{"error": CODE, "message": why}` with CODE the HTTP
status phrase (`NOT_FOUND`), the status chosen by the error's kind; credentials
checked on every path but the open ones; JSON request bodies and listings."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Collection
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from ..errors import StratamqError
from .credentials import Credentials
from .http_errors import BadRequestError, RequestTimeoutError, http_status

log = logging.getLogger(__name__)

# How long a request body may take to arrive (`admin.body_timeout`; the app's value).
BODY_TIMEOUT = web.AppKey("body_timeout", float)
DEFAULT_BODY_TIMEOUT = 30.0
# No request body of the APIs nests deeper than a few levels.
MAX_JSON_DEPTH = 32

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    code = HTTPStatus(status).phrase.upper().replace(" ", "_").replace("-", "_")
    return web.json_response({"error": code, "message": message}, status=status,
                             headers=headers)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error answered as JSON; an unexpected one is logged with its traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        if exc.status == 404:
            message = f"no such resource: {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = exc.reason
        return error_response(exc.status, message, headers)
    except StratamqError as exc:
        return error_response(http_status(exc), exc.message)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal error (see the log)")


def authentication(credentials: Credentials, open_paths: Collection[str]) -> Middleware:
    """A middleware that lets through `open_paths` and requests with valid
    credentials, and answers 401 to the rest (unknown paths too, so that a typo in a
    route never opens it)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths or \
                credentials.check(request.headers.get("Authorization")):
            return await handler(request)
        response = error_response(401, "missing or invalid credentials: send "
                                       "'Authorization: Bearer <token>' or basic credentials")
        for challenge in credentials.challenges():
            response.headers.add("WWW-Authenticate", challenge)
        return response

    return authenticate


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; BadRequestError when it is not one."""
    body = await json_value(request)
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    return body


async def json_value(request: web.Request) -> Any:
    """The request's JSON value; BadRequestError when the body is not JSON, nests
    deeper than MAX_JSON_DEPTH or holds a string that is not UTF-8 (a lone surrogate
    escape), RequestTimeoutError when it takes longer than the app's BODY_TIMEOUT."""
    timeout = request.app.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise RequestTimeoutError(f"the request body took longer than {timeout:g} s") from None
    except ConnectionError:  # the client went away mid-body: nobody to answer
        raise BadRequestError("the connection closed before the request body was in") from None
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadRequestError(f"the request body is nested too deeply (more than "
                              f"{MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:
        raise BadRequestError(f"the request body is not JSON: {exc}") from exc
    _check_json(value)
    return value


def _check_json(value: Any) -> None:
    """Depth and strings of a parsed JSON value, without recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequestError(f"the request body is nested too deeply (more than "
                                  f"{MAX_JSON_DEPTH} levels)")
        if isinstance(item, dict):
            pending.extend((key, depth) for key in item)
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequestError(f"the request body holds a string that is not "
                                      f"UTF-8 (a lone surrogate escape): {item[:80]!r}") from None


def listing(items: list[Any]) -> web.Response:
    return web.json_response({"data": items, "meta": {"count": len(items)}})
