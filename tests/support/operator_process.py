"""The stratamq operator as a real process: `kopf run -m stratamq.operator.handlers`
from the venv, against a test control plane's kubeconfig, with its liveness and
metrics endpoints on loopback ports."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from harness.processes import HOST, ManagedProcess, free_port
from tests.support.kube import ControlPlane

PEERING = "stratamq"


class OperatorProcess(ManagedProcess):
    name = "stratamq-operator"

    def __init__(self, workdir: Path, kube: ControlPlane, namespace: str | None, *,
                 priority: int | None = None, status_interval: float = 1.0,
                 reapply_interval: float = 300.0,
                 kubeconfig: Path | None = None, peering: str = PEERING,
                 spark_driver_role: str = "stratamq-spark", scanning: bool = True) -> None:
        """`namespace` None: all namespaces (a ClusterKopfPeering `peering`), else that
        one (a KopfPeering there); `kubeconfig`: whose credentials (the admin's by
        default); `spark_driver_role`: the ClusterRole the Spark drivers' accounts are
        bound to (the chart's Deployment names its own); `scanning` False: Kopf lists no
        namespaces and watches no CRDs (the chart's `operator.watchNamespaces`)."""
        super().__init__(workdir)  # self.port: the liveness endpoint
        self.log_path = workdir / "operator.log"
        self.kube = kube
        self.kubeconfig = kubeconfig or kube.kubeconfig
        self.namespace = namespace
        self.peering = peering
        self.priority = priority
        self.status_interval = status_interval
        self.reapply_interval = reapply_interval
        self.metrics_port = free_port()
        self.spark_driver_role = spark_driver_role
        self.scanning = scanning

    def ports(self) -> list[int]:
        return [self.port, self.metrics_port]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "KUBECONFIG": str(self.kubeconfig),
                "STRATAMQ_OPERATOR_STATUS_INTERVAL": str(self.status_interval),
                "STRATAMQ_OPERATOR_REAPPLY_INTERVAL": str(self.reapply_interval),
                "STRATAMQ_OPERATOR_METRICS_BIND": f"{HOST}:{self.metrics_port}",
                "STRATAMQ_OPERATOR_SPARK_DRIVER_ROLE": self.spark_driver_role,
                "STRATAMQ_OPERATOR_SCANNING": "on" if self.scanning else "off"}

    def command(self) -> list[str]:
        kopf = str(Path(sys.executable).parent / "kopf")
        scope = ("--all-namespaces" if self.namespace is None
                 else f"--namespace={self.namespace}")
        command = [kopf, "run", "-m", "stratamq.operator.handlers", scope,
                   f"--peering={self.peering}",
                   f"--liveness=http://{HOST}:{self.port}/healthz"]
        if self.priority is not None:
            command.append(f"--priority={self.priority}")
        return command


class Operators:
    """The operator processes of a test module, one at a time: `start()` starts the
    next (after `current` was killed or stopped)."""

    def __init__(self, kube: ControlPlane, workdir: Path, namespace: str, *,
                 reapply_interval: float = 300.0) -> None:
        self.kube = kube
        self.workdir = workdir
        self.namespace = namespace
        self.reapply_interval = reapply_interval
        self.started: list[OperatorProcess] = []

    def start(self) -> OperatorProcess:
        # Each above the last: a killed operator stays listed in the peering object
        # until its lifetime (60 s) ends, and one of a higher priority would make its
        # successor wait that long.
        process = OperatorProcess(self.workdir / f"operator-{len(self.started)}", self.kube,
                                  self.namespace, priority=100 + len(self.started),
                                  reapply_interval=self.reapply_interval)
        self.started.append(process)
        process.start(timeout=60)
        return process

    @property
    def current(self) -> OperatorProcess:
        return self.started[-1]

    def logs(self) -> str:
        return "\n".join(f"--- {process.workdir.name}:\n{process.log_tail(6000)}"
                         for process in self.started)


@contextlib.contextmanager
def peered_namespace(kube: ControlPlane, namespace: str) -> Iterator[ControlPlane]:
    """`namespace` made, with the KopfPeering object the operators elect through;
    deleted (without waiting) afterwards."""
    kube.kubectl("create", "namespace", namespace)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}}))
    yield kube
    kube.kubectl("delete", "namespace", namespace, "--wait=false")


@contextlib.contextmanager
def running_operators(kube: ControlPlane, workdir: Path, namespace: str, *,
                      reapply_interval: float = 300.0) -> Iterator[Operators]:
    """The operators of a test module, the first started; afterwards each is killed
    and none may have logged a traceback."""
    made = Operators(kube, workdir, namespace, reapply_interval=reapply_interval)
    made.start()
    yield made
    for process in made.started:
        process.kill()
    for process in made.started:
        assert "Traceback" not in process.log(), process.log_tail(6000)
