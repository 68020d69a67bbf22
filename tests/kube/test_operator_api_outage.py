"""The chart's one-shot commands, the uninstall hook and `helm test`, ride out an API
server that does not answer for a while (restarting; a load balancer in front of it
failing over). Since the operator's API client bounds every request
(`kube.API_TIMEOUT`), one request that failed failed the whole command, and with it
`helm uninstall` or `helm test`. Here each command reaches the real kube-apiserver
through a TCP proxy that closes every connection for some seconds from the first one,
then forwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import kopf
import yaml

from harness.netns import TcpProxy
from harness.processes import HOST
from tests.support.kube import ControlPlane, write_kubeconfig

FINALIZER = kopf.OperatorSettings().persistence.finalizer
# Far above the few immediate retries of a failed request the client makes itself.
OUTAGE_S = 4.0
COMMAND_TIMEOUT_S = 60


class OutageProxy(TcpProxy):
    """Closes each connection it takes in the OUTAGE_S from the first one, as an API
    server restarting (the client sees its connection reset); forwards after."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(HOST, target)
        self.outage_from: float | None = None  # read and set on the proxy's thread

    def _admits(self, source: str) -> bool:
        now = time.monotonic()
        if self.outage_from is None:
            self.outage_from = now
        return now - self.outage_from >= OUTAGE_S


def test_the_uninstall_hook_and_helm_test_wait_out_an_api_server_outage(
        crds: ControlPlane, namespace: str, tmp_path: Path) -> None:
    kube = crds
    name = "outage"
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": name, "finalizers": [FINALIZER]}, "spec": {}}))
    kube.kubectl("patch", "durablestorage", name, "-n", namespace, "--subresource=status",
                 "--type=merge", "-p", json.dumps({"status": {"phase": "Ready"}}))
    server = urlsplit(kube.apiserver.url)
    assert server.hostname and server.port
    commands = {
        "uninstall": ["stratamq.operator.uninstall", f"--namespace={namespace}",
                      "--deployment=no-such-operator", f"--watch-namespace={namespace}",
                      f"--timeout={COMMAND_TIMEOUT_S}"],
        "helm test": ["stratamq.operator.helm_test", f"--namespace={namespace}",
                      f"--storage={name}", f"--timeout={COMMAND_TIMEOUT_S}"],
    }
    proxies = {what: OutageProxy((server.hostname, server.port)) for what in commands}
    running = {}
    try:
        for what, args in commands.items():
            proxies[what].start()
            kubeconfig = tmp_path / f"{what.replace(' ', '-')}.kubeconfig"
            write_kubeconfig(kubeconfig, f"https://{HOST}:{proxies[what].port}", kube.pki)
            running[what] = subprocess.Popen(
                [sys.executable, "-m", *args],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ended = {what: (process.communicate(timeout=COMMAND_TIMEOUT_S + 30),
                        process.returncode) for what, process in running.items()}
    finally:
        for process in running.values():
            process.kill()
        for proxy in proxies.values():
            proxy.stop()
        kube.kubectl("patch", "durablestorage", name, "-n", namespace, "--type=json", "-p",
                     json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]),
                     check=False)

    (_, uninstall_err), uninstall_rc = ended["uninstall"]
    assert uninstall_rc == 0, uninstall_err
    assert "the API server:" in uninstall_err and "trying again" in uninstall_err, \
        uninstall_err
    assert f"{namespace}/{name}: finalizer {FINALIZER} removed" in uninstall_err, \
        uninstall_err
    # `helm test` got past the outage to what this storage lacks: a site.
    (_, test_err), test_rc = ended["helm test"]
    assert "trying again" in test_err, test_err
    assert test_rc == 1 and f"DurableStorage {namespace}/{name} is Ready but no site pod " \
        "is ready" in test_err, test_err
