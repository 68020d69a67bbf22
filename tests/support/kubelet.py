"""A test node that plays the kubelet (and the scheduler and the container runtime)
for the control plane of tests/support/kube.py, which has none of them.

It registers a Node (and keeps its Lease and Ready condition fresh, so the node
lifecycle controller never evicts its pods), watches the Pods of the namespaces it
serves, binds the unscheduled ones to itself, and runs each Pod's container as a REAL
process on the host:

- the Pod gets its own loopback address 127.A.B.N as its IP (Linux routes all of
  127/8 to loopback); a container in a real Pod has its own network namespace, where
  binding 0.0.0.0 means the Pod's IP, so the one translation made here is that a
  broker's `0.0.0.0:PORT` binds (read from the config file the container is started
  with) become `POD_IP:PORT` through the broker's `STRATAMQ__...` environment overrides;
- its volumes are folders: a ConfigMap's or Secret's keys written as files, a
  PersistentVolumeClaim one folder per claim name that outlives the Pod (a recreated
  StatefulSet pod finds its data again), an emptyDir one per Pod; the container's
  root is a folder per Pod where each volume is linked at its mountPath, and the
  process starts in `workingDir` under it (the operator's pods use paths relative to
  `/`, see stratamq.operator.config);
- the image is the project's venv: the command's first word is looked up in the
  venv's bin folder (`stratamq` is the image's entry point);
- env from `value` (with `$(VAR)` of the variables before it expanded, as the
  kubelet does), `secretKeyRef`, `configMapKeyRef` and `fieldRef`;
- Pod IP, phase Running, and the Ready condition from the container's readinessProbe
  (httpGet), asked about once a second; a process that exits is restarted
  (restartPolicy Always) with restartCount counted;
- a Pod being deleted: SIGTERM, SIGKILL after its grace period, then the Pod object
  is removed (what the kubelet does, so the StatefulSet controller can make the next);
  a Pod gone: its process is killed.

Liveness probes, init containers, resource limits and more than one container are not
played. `stop()` kills every process it started.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes import config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, DynamicApiError, NotFoundError

from tests.support.kube import ControlPlane

log = logging.getLogger(__name__)

NODE_PREFIX = "stratamq-test-node"
# Listener binds of the broker config the node turns into the Pod's own address.
BIND_KEYS = (("listeners", "tcp", "bind"), ("listeners", "ws", "bind"),
             ("listeners", "tls", "bind"), ("admin", "bind"), ("cluster", "peer_bind"))
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10.0
PROBE_SECONDS = 1.0
PROBE_TIMEOUT = 2.0


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def loopback_base() -> str:
    """`127.A.B.`: a /24 of loopback addresses for this node's pods, away from the
    127.0.0.x that other tests (and `stratamq cluster`) bind their standard ports on."""
    base = f"127.{random.randint(100, 250)}.{random.randint(1, 254)}."
    with socket.socket() as probe:
        try:
            probe.bind((base + "1", 0))
        except OSError as error:
            raise RuntimeError(f"cannot bind {base}1 on this machine ({error}): the test "
                               f"node gives each pod its own loopback address") from error
    return base


@dataclass
class Container:
    """One Pod's container, run as a process."""

    namespace: str
    pod: str
    uid: str
    ip: str
    command: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    probe_url: str | None
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    started_at: str = ""
    terminating: bool = False
    reported: dict[str, Any] = field(default_factory=dict)
    _log: IO[bytes] | None = None
    next_start: float = 0.0

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command, cwd=self.cwd, env=self.env, stdout=self._log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = now()
        self.ready = False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; waits for the exit."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def probe(self) -> bool:
        if self.probe_url is None:
            return self.alive()
        try:
            with urllib.request.urlopen(self.probe_url, timeout=PROBE_TIMEOUT) as response:
                return bool(200 <= response.status < 400)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except FileNotFoundError:
            return ""


class Kubelet:
    """The test node; `start()` registers it and starts serving `namespaces`."""

    def __init__(self, kube: ControlPlane, workdir: Path, namespaces: set[str]) -> None:
        self.kube = kube
        self.workdir = workdir
        self.namespaces = set(namespaces)
        self.api = config.new_client_from_config(config_file=str(kube.kubeconfig))
        self.dynamic = DynamicClient(self.api)
        self.pods = self.dynamic.resources.get(api_version="v1", kind="Pod")
        self.nodes = self.dynamic.resources.get(api_version="v1", kind="Node")
        self.leases = self.dynamic.resources.get(api_version="coordination.k8s.io/v1",
                                                 kind="Lease")
        self.bindings = self.dynamic.resources.get(api_version="v1", kind="Binding")
        self.config_maps = self.dynamic.resources.get(api_version="v1", kind="ConfigMap")
        self.secrets = self.dynamic.resources.get(api_version="v1", kind="Secret")
        self._terminating: set[str] = set()  # uids of pods being stopped
        self.base = loopback_base()
        self.node = f"{NODE_PREFIX}-{self.base.split('.')[1]}-{self.base.split('.')[2]}"
        self._next_ip = 1
        self.containers: dict[str, Container] = {}  # pod uid -> its container
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_heartbeat = 0.0
        self.errors: list[str] = []

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Kubelet:
        self._register_node()
        for target in (self._watch, self._sync_forever):
            thread = threading.Thread(target=target, name=f"kubelet-{target.__name__}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=30)
        with self._lock:
            containers = list(self.containers.values())
            self.containers.clear()
        for container in containers:
            container.stop(grace=5)
        with contextlib.suppress(DynamicApiError):
            self.dynamic.delete(self.nodes, name=self.node)
        self.api.close()

    # -- what the tests look at -----------------------------------------------------

    def container(self, namespace: str, pod: str) -> Container:
        """The running container of a pod (its newest incarnation)."""
        with self._lock:
            found = [c for c in self.containers.values()
                     if (c.namespace, c.pod) == (namespace, pod) and not c.terminating]
        assert found, f"no container runs for pod {namespace}/{pod}"
        return found[-1]

    def running(self, namespace: str) -> dict[str, Container]:
        """Pod name -> container, for the live containers of a namespace."""
        with self._lock:
            return {c.pod: c for c in self.containers.values()
                    if c.namespace == namespace and not c.terminating and c.alive()}

    # -- node -----------------------------------------------------------------------

    def _register_node(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": self.node,
            "labels": {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux"}}}
        with contextlib.suppress(ConflictError):
            self.dynamic.create(self.nodes, body=body)
        self._heartbeat()

    def _heartbeat(self) -> None:
        """Node status Ready and the node's Lease renewed: without them the node
        lifecycle controller taints the node and evicts its pods."""
        status = {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "the stratamq test node is serving",
                            "lastHeartbeatTime": now(), "lastTransitionTime": now()}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node}],
            "capacity": {"cpu": "64", "memory": "256Gi", "pods": "250"},
            "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "250"},
        }}
        self.dynamic.patch(self.nodes.subresources["status"], name=self.node, body=status,
                           content_type="application/merge-patch+json")
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_SECONDS,
                          "renewTime": now_micro()}}
        self.dynamic.server_side_apply(self.leases, body=lease, namespace="kube-node-lease",
                                       field_manager=self.node, force_conflicts=True)
        self._last_heartbeat = time.monotonic()

    # -- loops ----------------------------------------------------------------------

    def _watch(self) -> None:
        """Wake the sync loop on every pod event (the loop lists and acts)."""
        while not self._stopping.is_set():
            try:
                for _ in self.dynamic.watch(self.pods, timeout=5):
                    self._wake.set()
                    if self._stopping.is_set():
                        break
            except Exception as error:  # the API server restarting, a broken stream
                log.info("kubelet: pod watch ended (%s); watching again", error)
                time.sleep(0.5)

    def _sync_forever(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(PROBE_SECONDS)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self._sync()
            except Exception as error:
                # Kept for the tests to show; the loop goes on, as a kubelet would.
                log.exception("kubelet: sync failed")
                self.errors.append(repr(error))
                time.sleep(0.5)

    def _pods(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for namespace in sorted(self.namespaces):
            found += self.dynamic.get(self.pods, namespace=namespace).to_dict()["items"]
        return found

    def _sync(self) -> None:
        if time.monotonic() - self._last_heartbeat > HEARTBEAT_SECONDS:
            self._heartbeat()
        pods = self._pods()
        seen = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            seen.add(meta["uid"])
            if not spec.get("nodeName"):
                if not meta.get("deletionTimestamp"):
                    self._bind(meta["namespace"], meta["name"])
                continue
            if spec["nodeName"] != self.node:
                continue
            with self._lock:
                container = self.containers.get(meta["uid"])
            if meta.get("deletionTimestamp"):
                self._terminate(pod, container)
            elif container is None:
                self._run(pod)
            else:
                self._tend(pod, container)
        with self._lock:
            gone = [uid for uid in self.containers
                    if uid not in seen and uid not in self._terminating]
            removed = [self.containers.pop(uid) for uid in gone]
        for container in removed:  # deleted at once (grace 0, or its namespace went)
            container.stop(grace=0)

    # -- one pod --------------------------------------------------------------------

    def _bind(self, namespace: str, name: str) -> None:
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
        # Gone, or bound meanwhile: nothing to do.
        with contextlib.suppress(NotFoundError, ConflictError):
            self.dynamic.create(self.bindings, body=binding, namespace=namespace)

    def _run(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with self._lock:
            ip = f"{self.base}{self._next_ip}"
            self._next_ip += 1
        try:
            container = self._prepare(pod, ip)
        except (RuntimeError, DynamicApiError, KeyError) as error:
            # As a kubelet reports a container it cannot create, and tries again.
            log.warning("kubelet: cannot start %s/%s: %s", meta["namespace"], meta["name"],
                        error)
            self.errors.append(f"{meta['namespace']}/{meta['name']}: {error}")
            return
        container.start()
        with self._lock:
            self.containers[meta["uid"]] = container
        self._report(pod, container)

    def _tend(self, pod: dict[str, Any], container: Container) -> None:
        if not container.alive():
            container.ready = False
            if container.next_start == 0.0:
                # Back off as a kubelet does (capped low: tests wait on it).
                container.next_start = time.monotonic() + min(2 ** container.restarts, 10)
            elif time.monotonic() >= container.next_start:
                container.stop(grace=0)
                container.restarts += 1
                container.next_start = 0.0
                container.start()
        else:
            container.ready = container.probe()
        self._report(pod, container)

    def _terminate(self, pod: dict[str, Any], container: Container | None) -> None:
        meta = pod["metadata"]
        with self._lock:
            if meta["uid"] in self._terminating:
                return
            self._terminating.add(meta["uid"])
        if container is not None:
            container.terminating = True
        grace = float(meta.get("deletionGracePeriodSeconds")
                      or pod["spec"].get("terminationGracePeriodSeconds", 30))

        def finish() -> None:
            if container is not None:
                container.stop(grace)
            # The kubelet's last word: the pod object goes, its name is free again.
            with contextlib.suppress(DynamicApiError):
                self.dynamic.delete(self.pods, name=meta["name"], namespace=meta["namespace"],
                                    body={"gracePeriodSeconds": 0,
                                          "preconditions": {"uid": meta["uid"]}})
            with self._lock:
                self.containers.pop(meta["uid"], None)
                self._terminating.discard(meta["uid"])
            self._wake.set()

        threading.Thread(target=finish, name=f"kubelet-stop-{meta['name']}",
                         daemon=True).start()

    def _report(self, pod: dict[str, Any], container: Container) -> None:
        """Patch the pod's status when what it says changed."""
        spec = pod["spec"]["containers"][0]
        running = container.alive()
        ready = running and container.ready
        state: dict[str, Any] = ({"running": {"startedAt": container.started_at}} if running
                                 else {"waiting": {"reason": "CrashLoopBackOff"}})
        wanted = {"ip": container.ip, "ready": ready, "running": running,
                  "restarts": container.restarts, "startedAt": container.started_at}
        if wanted == container.reported:
            return
        since = now()
        status = {"status": {
            "phase": "Running", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": container.ip, "podIPs": [{"ip": container.ip}],
            "startTime": pod["status"].get("startTime") or since,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": since},
                {"type": "Initialized", "status": "True", "lastTransitionTime": since},
                {"type": "ContainersReady", "status": str(ready),
                 "lastTransitionTime": since},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": since},
            ],
            "containerStatuses": [{
                "name": spec["name"], "image": spec.get("image", ""), "imageID": "",
                "containerID": f"stratamq-test://{container.uid}-{container.restarts}",
                "ready": ready, "started": running, "restartCount": container.restarts,
                "state": state}],
        }}
        try:
            self.dynamic.patch(self.pods.subresources["status"], name=pod["metadata"]["name"],
                               namespace=pod["metadata"]["namespace"], body=status,
                               content_type="application/strategic-merge-patch+json")
        except NotFoundError:
            return
        container.reported = wanted

    # -- making a container -----------------------------------------------------------

    def _prepare(self, pod: dict[str, Any], ip: str) -> Container:
        meta, spec = pod["metadata"], pod["spec"]
        namespace = meta["namespace"]
        pod_dir = self.workdir / "pods" / f"{namespace}_{meta['name']}_{meta['uid']}"
        if pod_dir.exists():
            shutil.rmtree(pod_dir)
        root = pod_dir / "root"
        root.mkdir(parents=True)
        volumes = {volume["name"]: self._volume(namespace, volume, pod_dir / "volumes")
                   for volume in spec.get("volumes", [])}
        [container] = spec["containers"]
        for mount in container.get("volumeMounts", []):
            if mount.get("subPath"):
                raise RuntimeError("volumeMounts with subPath are not played")
            target = root / mount["mountPath"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(volumes[mount["name"]], target_is_directory=True)
        cwd = root / container.get("workingDir", "/").lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        argv = [*container.get("command", []), *container.get("args", [])]
        if not argv:
            raise RuntimeError("the container has no command (the image's entry point "
                               "is not known here)")
        program = Path(sys.executable).parent / argv[0]
        if not os.access(program, os.X_OK):
            raise RuntimeError(f"{argv[0]!r} is not in the image (the venv's bin folder)")
        env = {"PATH": f"{program.parent}:/usr/bin:/bin", "HOME": str(root),
               "PYTHONUNBUFFERED": "1", "HOSTNAME": meta["name"]}
        for variable in container.get("env", []):
            env[variable["name"]] = self._env_value(pod, ip, variable, env)
        env |= self._bind_overrides(argv, cwd, ip)
        return Container(
            namespace=namespace, pod=meta["name"], uid=meta["uid"], ip=ip,
            command=[str(program), *argv[1:]], env=env, cwd=cwd,
            log_path=pod_dir / "container.log",
            probe_url=self._probe_url(container, ip))

    def _volume(self, namespace: str, volume: dict[str, Any], under: Path) -> Path:
        if "persistentVolumeClaim" in volume:
            # One folder per claim, kept across pods: what a bound volume is.
            claim: str = volume["persistentVolumeClaim"]["claimName"]
            kept = self.workdir / "volumes" / namespace / claim
            kept.mkdir(parents=True, exist_ok=True)
            return kept
        path = under / str(volume["name"])
        path.mkdir(parents=True)
        if "emptyDir" in volume:
            return path
        if "configMap" in volume:
            data = self._read(self.config_maps, namespace, volume["configMap"]["name"])
            files = {key: value.encode() for key, value in data.items()}
        elif "secret" in volume:
            data = self._read(self.secrets, namespace, volume["secret"]["secretName"])
            files = {key: base64.b64decode(value) for key, value in data.items()}
        else:
            raise RuntimeError(f"volume {volume['name']!r}: only configMap, secret, "
                               f"persistentVolumeClaim and emptyDir are played")
        for key, content in files.items():
            (path / key).write_bytes(content)
        return path

    def _env_value(self, pod: dict[str, Any], ip: str, variable: dict[str, Any],
                   defined: dict[str, str]) -> str:
        if "value" in variable:
            return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                          lambda match: defined.get(match.group(1), match.group(0)),
                          str(variable["value"]))
        source = variable["valueFrom"]
        namespace = pod["metadata"]["namespace"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return base64.b64decode(self._read(self.secrets, namespace, ref["name"])[
                ref["key"]]).decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return str(self._read(self.config_maps, namespace, ref["name"])[ref["key"]])
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod["metadata"]["name"],
                      "metadata.namespace": namespace, "status.podIP": ip,
                      "spec.nodeName": self.node}
            return str(fields[path])
        raise RuntimeError(f"env {variable['name']}: {sorted(source)} is not played")

    def _read(self, resource: Any, namespace: str, name: str) -> dict[str, str]:
        """The `data` of a ConfigMap or Secret."""
        found: dict[str, str] = self.dynamic.get(resource, name=name,
                                                 namespace=namespace).to_dict().get("data") or {}
        return found

    @staticmethod
    def _bind_overrides(argv: list[str], cwd: Path, ip: str) -> dict[str, str]:
        """`0.0.0.0:PORT` binds of the broker config in `--config` as POD_IP:PORT."""
        if "--config" not in argv:
            return {}
        config_path = cwd / argv[argv.index("--config") + 1]
        data = yaml.safe_load(config_path.read_text()) or {}
        overrides = {}
        for keys in BIND_KEYS:
            node: Any = data
            for key in keys[:-1]:
                node = node.get(key, {}) if isinstance(node, dict) else {}
            bind = node.get(keys[-1]) if isinstance(node, dict) else None
            if isinstance(bind, str) and bind.startswith("0.0.0.0:"):
                name = "STRATAMQ__" + "__".join(key.upper() for key in keys)
                overrides[name] = f"{ip}:{bind.rsplit(':', 1)[1]}"
        return overrides

    @staticmethod
    def _probe_url(container: dict[str, Any], ip: str) -> str | None:
        probe = container.get("readinessProbe", {}).get("httpGet")
        if probe is None:
            return None
        port = probe["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.get("ports", [])
                        if p.get("name") == port)
        return f"http://{ip}:{port}{probe.get('path', '/')}"


@contextlib.contextmanager
def running_kubelet(kube: ControlPlane, workdir: Path, namespaces: set[str]
                    ) -> Iterator[Kubelet]:
    node = Kubelet(kube, workdir, namespaces).start()
    try:
        yield node
    finally:
        node.stop()
