"""Real Kubernetes nodes on this one machine: the test control plane (kube.py) plus
kube-scheduler, and N nodes, each a real kubelet with its own containerd (root, state
and socket under the test's folder) running the built images as real containers.

Networking: no bridges, no NAT, no private addresses are available here, so node N is
a kubelet at its own loopback address 127.0.0.(50+N), registered with
`--cloud-provider=external` and given that address as a cloud controller would; the
pods of the tests that need to reach each other run on
the host network (DurableStorage `spec.hostNetwork`, the chart's
`operator.hostNetwork`) and bind their pod IP, which is their node's address. Services
(ClusterIPs: no kube-proxy) and cluster DNS are not exercised this way. All traffic
stays on 127.0.0.0/8.

Pods off the host network (those a Pod Security "restricted" namespace admits) get an
`eth0` from a `macvlan` CNI network on a veth pair the cluster makes (no bridge, no
route, no NAT), with an address from 127.0.200.0/24. That is enough to run them, not to
reach them: inside a pod, as on the host, all of 127.0.0.0/8 is the pod's own loopback,
so such a pod reaches nothing outside itself and nothing reaches it.

The host is left as found: the kubelet sets `vm.overcommit_memory`, `kernel.panic`,
`kernel.panic_on_oops` (and a few more) at start, adds `KUBE-*` iptables chains, makes
folders and mounts. `RealKubeCluster` records every such setting before the first kubelet
starts, puts them back right after each kubelet's start and at `stop()`, removes the
chains it added, kills the containers and their shims, unmounts everything under its
folder and removes what it created. `stop()` runs also after a failed start.

Needs root, Debian's `containerd`, `runc`, `containernetworking-plugins` and
`iptables`, `make kube-bin` (kubelet, kube-scheduler) and the images of
images/build-local.sh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from harness.processes import ManagedProcess
from tests.support.kube import ControlPlane, kube_binary

# The pause image containerd makes each pod's sandbox of (images/build-local.sh).
PAUSE_IMAGE = "docker.io/local/pause:3.10"
CNI_PLUGINS = Path("/usr/lib/cni")
FIRST_NODE_ADDRESS = 50  # node N is 127.0.0.(50+N)
# What the kubelet changes on the host at start (kubelet's container manager).
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
# Folders the kubelet and containerd make outside their configured roots.
HOST_PATHS = (Path("/var/lib/kubelet"), Path("/var/log/containers"), Path("/var/log/pods"),
              Path("/var/lib/cni"), Path("/run/containerd"), Path("/opt/containerd"))
IPTABLES = ("iptables", "ip6tables")
IPTABLES_TABLES = ("filter", "nat", "mangle")
REQUIRED_COMMANDS = ("containerd", "ctr", "runc", "iptables", "mount", "umount", "ip")
# The pod network's lower device (a veth pair: this kernel may lack `dummy`), its
# addresses, and where containerd bind-mounts each pod's network namespace.
POD_NETWORK_LINK = "stratamq-pods0"
POD_NETWORK_PEER = "stratamq-pods1"
POD_NETWORK_SUBNET = "127.0.200.0/24"
NETNS_MOUNTS = Path("/run/netns")
# The kubelets evict (and taint their node) when the host disk's free space falls
# under this share of it; importing an image checks there is room above it first.
EVICTION_FREE_PERCENT = 1
FREE_MARGIN_BYTES = 2 << 30
# How many copies of an imported archive's layers a node keeps (content store, snapshot).
IMPORTED_COPIES = 2


def missing_prerequisites() -> str | None:
    """Why real nodes cannot run here, or None."""
    if os.geteuid() != 0:
        return "real nodes need root (a kubelet and containerd)"
    for command in REQUIRED_COMMANDS:
        if shutil.which(command) is None and not Path("/usr/sbin", command).exists():
            return (f"real nodes need `{command}` (Debian: containerd runc "
                    f"containernetworking-plugins iptables)")
    for plugin in ("loopback", "macvlan", "host-local"):
        if not (CNI_PLUGINS / plugin).exists():
            return (f"real nodes need the CNI {plugin} plugin "
                    f"(Debian: containernetworking-plugins)")
    return None


def node_address(index: int) -> str:
    return f"127.0.0.{FIRST_NODE_ADDRESS + index}"


def run(*command: str, check: bool = True, timeout: float = 120,
        input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(command, capture_output=True, timeout=timeout, check=False,
                            input=input)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {result.returncode}:\n"
                           + result.stderr.decode(errors="replace"))
    return result


# --- processes ------------------------------------------------------------------------

class KubeScheduler(ManagedProcess):
    name = "kube-scheduler"

    def __init__(self, workdir: Path, kubeconfig: Path) -> None:
        super().__init__(workdir)
        self.log_path = workdir / "kube-scheduler.log"
        self.kubeconfig = kubeconfig

    def ports(self) -> list[int]:
        return []  # serves nothing here (--secure-port=0)

    def command(self) -> list[str]:
        return [str(kube_binary("kube-scheduler")), f"--kubeconfig={self.kubeconfig}",
                "--authentication-skip-lookup", "--leader-elect=false", "--secure-port=0"]


class Containerd(ManagedProcess):
    name = "containerd"

    def __init__(self, workdir: Path, cni: Path) -> None:
        super().__init__(workdir)
        self.log_path = workdir / "containerd.log"
        self.socket = workdir / "containerd.sock"
        self.config = workdir / "containerd.toml"
        self.config.write_text(f"""version = 2
root = "{workdir / 'root'}"
state = "{workdir / 'state'}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_cdi = false
  # Root here lacks CAP_SYS_RESOURCE: no lowering of a container's OOM score.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{cni}"
""")

    def ports(self) -> list[int]:
        return []

    def command(self) -> list[str]:
        return ["nice", "-n", "5", "containerd", "--config", str(self.config)]

    def ctr(self, *args: str, input: bytes | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
        return run("ctr", "--address", str(self.socket), "-n", "k8s.io", *args,
                   input=input, check=check, timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.ctr("version", check=False).returncode != 0:
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start:\n{self.log_tail()}")
            time.sleep(0.2)

    def kill_containers(self) -> None:
        """SIGKILL every container it runs and its shim (found by this socket in the
        shim's command line: shims outlive containerd)."""
        if self.alive():
            for task in self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", "--all", task, check=False)
        for pid in _pids_with_argument(str(self.socket)):
            if pid != (self.process.pid if self.process else None):
                _kill_tree(pid)


class Kubelet(ManagedProcess):
    name = "kubelet"

    def __init__(self, workdir: Path, index: int, kubeconfig: Path, runtime: Path) -> None:
        super().__init__(workdir)
        self.index = index
        self.node = f"node-{index}"
        self.address = node_address(index)
        self.log_path = workdir / "kubelet.log"
        self.kubeconfig = kubeconfig
        self.config = workdir / "kubelet.yaml"
        self.config.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.address, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": self.address, "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": True},
                               "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "containerRuntimeEndpoint": f"unix://{runtime}",
            "failSwapOn": False, "podLogsDir": str(workdir / "pod-logs"),
            "serializeImagePulls": False,
            # The images are imported, never pulled: never collect them, and evict
            # nothing for a host disk the other tests share.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi",
                             "nodefs.available": f"{EVICTION_FREE_PERCENT}%",
                             "imagefs.available": f"{EVICTION_FREE_PERCENT}%"},
            "registerNode": True, "clusterDomain": "cluster.local",
            # Status often enough for tests that wait on it.
            "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
        }))

    def ports(self) -> list[int]:
        return []

    def command(self) -> list[str]:
        return ["nice", "-n", "5", str(kube_binary("kubelet")), f"--config={self.config}",
                f"--kubeconfig={self.kubeconfig}", f"--root-dir={self.workdir / 'root'}",
                # Its own serving certificate: by default every node's kubelet makes one
                # in the host's /var/lib/kubelet/pki, and one starting beside another
                # read the other's half-written file ("missing content for serving
                # cert") and exited.
                f"--cert-dir={self.workdir / 'pki'}",
                f"--hostname-override={self.node}", "--cloud-provider=external", "--v=1"]


def _pids_with_argument(argument: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (the shim and its container's processes,
    which run in their own process groups)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    pending, tree = [pid], []
    while pending:
        current = pending.pop()
        tree.append(current)
        pending += children.get(current, [])
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


# --- host state -----------------------------------------------------------------------

class HostState:
    """What the kubelets change on the host, recorded before and put back after."""

    def __init__(self) -> None:
        self.sysctls = {name: Path("/proc/sys", name).read_text() for name in SYSCTLS
                        if Path("/proc/sys", name).exists()}
        self.paths = [path for path in HOST_PATHS if not path.exists()]
        self.chains = {(tool, table): self._chains(tool, table)
                       for tool in IPTABLES for table in IPTABLES_TABLES}
        self.cgroups = {path for path in Path("/sys/fs/cgroup").glob("*/k8s.io")}
        self.netns_mounts_existed = NETNS_MOUNTS.exists()
        self.netns = set(NETNS_MOUNTS.iterdir()) if self.netns_mounts_existed else set()

    @staticmethod
    def _chains(tool: str, table: str) -> set[str]:
        result = run(tool, "-w", "-t", table, "-S", check=False)
        return {line.split()[1] for line in result.stdout.decode().splitlines()
                if line.startswith("-N ")}

    def restore_sysctls(self) -> None:
        for name, value in self.sysctls.items():
            with contextlib.suppress(OSError):
                if Path("/proc/sys", name).read_text() != value:
                    Path("/proc/sys", name).write_text(value)

    def restore(self) -> list[str]:
        """Everything back; returns what could not be (for the test's report)."""
        problems: list[str] = []
        self.restore_sysctls()
        for (tool, table), before in self.chains.items():
            added = {chain for chain in self._chains(tool, table) - before
                     if chain.startswith("KUBE-")}
            if not added:
                continue
            # First the rules that jump to them (from any chain), then the chains.
            for line in run(tool, "-w", "-t", table, "-S", check=False).stdout.decode(
                    ).splitlines():
                words = line.split()
                jumps_to_added = any(words[i] == "-j" and words[i + 1] in added
                                     for i in range(len(words) - 1))
                if words[:1] == ["-A"] and words[1] not in added and jumps_to_added:
                    run(tool, "-w", "-t", table, "-D", *words[1:], check=False)
            for chain in added:
                run(tool, "-w", "-t", table, "-F", chain, check=False)
            for chain in added:
                if run(tool, "-w", "-t", table, "-X", chain, check=False).returncode:
                    problems.append(f"{tool} -t {table}: chain {chain} left")
        for group in sorted(set(Path("/sys/fs/cgroup").glob("*/k8s.io")) - self.cgroups):
            for child in sorted(group.glob("*/"), reverse=True):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()
        # The pods' network namespaces containerd had no time to remove.
        for namespace in sorted(set(NETNS_MOUNTS.glob("cni-*")) - self.netns):
            run("umount", "-l", str(namespace), check=False)
            with contextlib.suppress(OSError):
                namespace.unlink()
            if namespace.exists():
                problems.append(f"{namespace} left")
        if not self.netns_mounts_existed:
            with contextlib.suppress(OSError):
                NETNS_MOUNTS.rmdir()
        for path in self.paths:
            unmount_under(path)
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                problems.append(f"{path} left")
        return problems


def unmount_under(folder: Path) -> None:
    """Unmount every mount point at or under `folder`, deepest first."""
    resolved = str(folder.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == resolved or point.startswith(resolved + "/"):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        run("umount", "-l", point, check=False)


# --- the Kubernetes cluster -----------------------------------------------------------

class RealKubeCluster:
    """The control plane, a scheduler and `nodes` real nodes in `workdir`."""

    def __init__(self, workdir: Path, images: list[Path], nodes: int = 3) -> None:
        self.workdir = workdir
        self.images = images
        self.host = HostState()
        self.plane = ControlPlane(workdir / "control-plane")
        self.scheduler = KubeScheduler(workdir / "scheduler", self.plane.kubeconfig)
        cni = workdir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-pods.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "stratamq-pods", "plugins": [{
                "type": "macvlan", "master": POD_NETWORK_LINK, "mode": "bridge",
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_NETWORK_SUBNET}]],
                         "dataDir": str(workdir / "pod-addresses")}}]}))
        self.runtimes = [Containerd(workdir / f"node-{index}" / "containerd", cni)
                         for index in range(nodes)]
        self.kubelets = [Kubelet(workdir / f"node-{index}" / "kubelet", index,
                                 self.plane.kubeconfig, runtime.socket)
                         for index, runtime in enumerate(self.runtimes)]
        self.volumes = workdir / "volumes"
        self.problems: list[str] = []

    def get_json(self, namespace: str, *what: str) -> Any:
        """`kubectl get -o json` of `what` in `namespace`, parsed."""
        return json.loads(self.plane.kubectl("get", "-n", namespace, "-o", "json",
                                             *what).stdout)

    def start(self, timeout: float = 300) -> RealKubeCluster:
        deadline = time.monotonic() + timeout
        make_pod_network_link()
        self.plane.start(timeout)
        self.scheduler.start()
        for runtime in self.runtimes:
            runtime.start()
        self.import_images(self.images)
        for kubelet in self.kubelets:
            kubelet.start()
        for kubelet in self.kubelets:
            self._initialize(kubelet, deadline)
        self.plane.kubectl("wait", "--for=condition=Ready", "node", "--all",
                           f"--timeout={max(1, int(deadline - time.monotonic()))}s",
                           timeout=timeout)
        return self

    def import_images(self, archives: list[Path], nodes: Sequence[int] | None = None
                      ) -> None:
        """Docker archives imported into the containerd of `nodes` (their indexes; every
        node by default), as a registry's pull would put them there. Refused first, with
        the figures, where the disk cannot hold them: a disk filled by an import puts
        every node under disk pressure, and no pod is scheduled for minutes after."""
        runtimes = self.runtimes if nodes is None else [self.runtimes[n] for n in nodes]
        self._check_room(archives, len(runtimes))

        def import_into(runtime: Containerd) -> None:
            runtime.wait_ready()
            for archive in archives:  # (the Spark image: 1.6 GB)
                runtime.ctr("images", "import", str(archive), timeout=900)
        # Each node's containerd unpacks its own copy: side by side, not one by one.
        with ThreadPoolExecutor(len(runtimes)) as pool:
            list(pool.map(import_into, runtimes))

    def image_names(self, node: int) -> set[str]:
        """The names of the images in the containerd of node `node` (its index)."""
        return set(self.runtimes[node].ctr("images", "ls", "-q").stdout.decode().split())

    def remove_images(self, names: list[str], nodes: Sequence[int] | None = None) -> None:
        """The images `names` (as `ctr images ls` names them) removed from the containerd
        of `nodes` (every node by default), their layers' space given back before this
        returns (the next tests share the disk)."""
        for index in range(len(self.runtimes)) if nodes is None else nodes:
            self.runtimes[index].ctr("images", "rm", "--sync", *names, timeout=300)

    def _check_room(self, archives: list[Path], nodes: int) -> None:
        size = sum(archive.stat().st_size for archive in archives)
        # A node keeps an archive's layers twice: in its content store and unpacked.
        needed = IMPORTED_COPIES * size * nodes
        disk = shutil.disk_usage(self.workdir)
        # What the kubelets' eviction threshold keeps free, and a margin for the tests.
        keep = disk.total * EVICTION_FREE_PERCENT / 100 + FREE_MARGIN_BYTES
        if disk.free - needed < keep:
            gib = 1 << 30
            raise RuntimeError(
                f"importing {', '.join(archive.name for archive in archives)} "
                f"({size / gib:.1f} GiB) into {nodes} node(s) needs {needed / gib:.1f} GiB "
                f"and {keep / gib:.1f} GiB left free; {self.workdir} has "
                f"{disk.free / gib:.1f} GiB free")

    def _initialize(self, kubelet: Kubelet, deadline: float) -> None:
        """What a cloud controller does for a node: its address, and the taint off."""
        while self.plane.kubectl("get", "node", kubelet.node, check=False).returncode:
            if not kubelet.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{kubelet.node} did not register:\n{kubelet.log_tail()}")
            time.sleep(0.5)
        # The kubelet set its kernel tunables at start, before registering.
        self.host.restore_sysctls()
        self.plane.kubectl("patch", "node", kubelet.node, "--subresource=status",
                           "--type=merge", "-p", json.dumps({"status": {"addresses": [
                               {"type": "InternalIP", "address": kubelet.address},
                               {"type": "Hostname", "address": kubelet.node}]}}))
        self.plane.kubectl("taint", "node", kubelet.node,
                           "node.cloudprovider.kubernetes.io/uninitialized-")

    def add_volumes(self, count: int, size: str = "1Gi") -> None:
        """`count` more hostPath PersistentVolumes of no class (the claims of a
        StatefulSet without storageClassName bind them), writable by the images' user."""
        existing = len(list(self.volumes.glob("pv-*"))) if self.volumes.exists() else 0
        for index in range(existing, existing + count):
            path = self.volumes / f"pv-{index}"
            path.mkdir(parents=True)
            os.chown(path, 10001, 10001)
            self.plane.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": f"pv-{index}"},
                "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                         "persistentVolumeReclaimPolicy": "Retain",
                         "hostPath": {"path": str(path), "type": "Directory"}}}))

    def chart_settings(self) -> list[str]:
        """The chart's values these nodes need, as `helm install` arguments: the
        operator on the host network, reaching the API server at its loopback address
        (no kube-proxy routes the `kubernetes` Service), its image imported, not pulled.
        Neither argument holds a space (tools/kind/scenario.sh splits them on spaces)."""
        environment = [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.plane.apiserver.port)}]
        return ["--set", "operator.hostNetwork=true",
                "--set-json", "operator.env=" + json.dumps(environment, separators=(",", ":")),
                "--set", "operator.image.pullPolicy=Never", "--set", "dashboards.enabled=false"]

    def install_chart(self, chart: Path, release: str, namespace: str, *settings: str,
                      timeout: int = 180) -> None:
        """`helm install --wait` of the chart with `chart_settings` (and `settings`)."""
        self.plane.helm(
            "install", release, str(chart), "--namespace", namespace, "--create-namespace",
            *self.chart_settings(), *settings, "--wait", f"--timeout={timeout}s",
            timeout=timeout + 30)

    def runtime_of(self, pod: dict[str, Any]) -> Containerd:
        """The containerd of the node `pod` (its JSON) runs on."""
        [runtime] = [runtime for runtime, kubelet in zip(self.runtimes, self.kubelets,
                                                         strict=True)
                     if kubelet.node == pod["spec"]["nodeName"]]
        return runtime

    def kill_container(self, pod: dict[str, Any]) -> None:
        """SIGKILL the (first) container of `pod` (its JSON) through its node's
        containerd, as a crash would: the kubelet restarts it in the same pod."""
        container = pod["status"]["containerStatuses"][0]["containerID"]
        self.runtime_of(pod).ctr("tasks", "kill", "-s", "SIGKILL",
                                 container.removeprefix("containerd://"))

    def container_process(self, pod: dict[str, Any]) -> int | None:
        """The host PID of the (first) container of `pod` (its JSON) while it runs."""
        statuses = pod["status"].get("containerStatuses") or [{}]
        container = statuses[0].get("containerID", "").removeprefix("containerd://")
        if not container:
            return None
        tasks = self.runtime_of(pod).ctr("tasks", "ls", check=False).stdout.decode(
            ).splitlines()[1:]
        for task, pid, state in (line.split() for line in tasks):
            if task == container and state == "RUNNING":
                return int(pid)
        return None

    def stop(self) -> list[str]:
        """Everything stopped and the host as it was; returns what was left (empty)."""
        for kubelet in self.kubelets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                kubelet.stop(timeout=20)
            kubelet.kill()
        for runtime in self.runtimes:
            runtime.kill_containers()
            with contextlib.suppress(subprocess.TimeoutExpired):
                runtime.stop(timeout=20)
            runtime.kill()
            runtime.kill_containers()  # shims that were still starting
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.scheduler.stop(timeout=10)
        self.scheduler.kill()
        self.plane.stop()
        unmount_under(self.workdir)
        self.problems = self.host.restore()
        # Its pods' macvlan links went with their network namespaces.
        run("ip", "link", "delete", POD_NETWORK_LINK, check=False)
        if Path("/sys/class/net", POD_NETWORK_LINK).exists():
            self.problems.append(f"link {POD_NETWORK_LINK} left")
        return self.problems


def make_pod_network_link() -> None:
    """The veth pair the pods' macvlan links hang off; one a crashed run left is ours."""
    run("ip", "link", "delete", POD_NETWORK_LINK, check=False)
    run("ip", "link", "add", POD_NETWORK_LINK, "type", "veth", "peer", "name",
        POD_NETWORK_PEER)
    for link in (POD_NETWORK_LINK, POD_NETWORK_PEER):
        run("ip", "link", "set", link, "up")
