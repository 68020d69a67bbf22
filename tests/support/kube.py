"""A real Kubernetes control plane for the tests, as controller-runtime's envtest runs
one: etcd, kube-apiserver and kube-controller-manager on loopback ports, built from
source by `make kube-bin` into .cache/bin. There is no kubelet and no scheduler, so
Pods are created (by the StatefulSet controller, say) but stay Pending.

The API server serves TLS with a certificate from a throwaway CA made here; the admin
user authenticates with a client certificate of that CA in group `system:masters`
(what kubeadm's admin.conf does), written into a kubeconfig the real `kubectl` and
`helm` use."""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness.processes import HOST, REPO, ManagedProcess, free_port
from harness.waiting import wait_for

KUBE_BIN = Path(os.environ.get("STRATAMQ_KUBE_BIN", REPO / ".cache" / "bin"))
# The ClusterIP range of Services; the API server's own Service takes its first address.
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


def kube_binary(name: str) -> Path:
    path = KUBE_BIN / name
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is missing: build the Kubernetes test binaries with "
                           f"`make kube-bin` (make test does it)")
    return path


# --- certificates ---------------------------------------------------------------------

@dataclass(frozen=True)
class Pki:
    """Files of the throwaway CA and what it signed, all PEM."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    # Service-account tokens: signed by the API server, verified by it, and minted for
    # legacy token Secrets by the controller manager.
    service_account_key: Path
    service_account_pub: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 usage: Sequence[x509.ObjectIdentifier] = (),
                 san: Sequence[x509.GeneralName] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               # Backdated: the processes' clocks are the same, but a second's rounding
               # must not make a fresh certificate "not yet valid".
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(*(directory / name for name in (
        "ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key",
        "sa.key", "sa.pub")))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("stratamq-test-ca")
    ca_cert = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _certificate(
        _name("kube-apiserver"), server_key, ca_name, ca_key,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        san=[x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost"),
             # The API server's in-cluster Service address and names.
             x509.IPAddress(next(ipaddress.IPv4Network(SERVICE_CIDR).hosts())),
             x509.DNSName("kubernetes.default.svc")])
    # The group system:masters is bound to cluster-admin by the API server's defaults.
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin_cert = _certificate(_name("stratamq-test-admin", "system:masters"), admin_key,
                              ca_name, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    service_account_key = ec.generate_private_key(ec.SECP256R1())
    for path, cert in ((pki.ca_cert, ca_cert), (pki.server_cert, server_cert),
                       (pki.admin_cert, admin_cert)):
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for path, key in ((pki.ca_key, ca_key), (pki.server_key, server_key),
                      (pki.admin_key, admin_key), (pki.service_account_key, service_account_key)):
        _write_key(path, key)
    pki.service_account_pub.write_bytes(service_account_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki


def write_kubeconfig(path: Path, server: str, pki: Pki) -> None:
    def data(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "stratamq-test",
        "clusters": [{"name": "stratamq-test", "cluster": {
            "server": server, "certificate-authority-data": data(pki.ca_cert)}}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": data(pki.admin_cert),
            "client-key-data": data(pki.admin_key)}}],
        "contexts": [{"name": "stratamq-test", "context": {
            "cluster": "stratamq-test", "user": "admin", "namespace": "default"}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


# --- processes ------------------------------------------------------------------------

class Etcd(ManagedProcess):
    name = "etcd"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.log_path = workdir / "etcd.log"
        self.peer_port = free_port()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        peer = f"http://{HOST}:{self.peer_port}"
        return [str(kube_binary("etcd")), "--name=test", f"--data-dir={self.workdir / 'data'}",
                f"--listen-client-urls={self.url}", f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}", "--log-level=warn",
                # Throwaway data: an fsync per write only slows the tests down.
                "--unsafe-no-fsync=true"]


# What the API server's audit log records: who listed or watched pods (the operator
# reads its sites' pods from a watch, not a list every round), nothing else. A list
# is recorded once (ResponseComplete), a watch as it starts (ResponseStarted: it is
# complete only when it ends) and again when it ends.
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata", "verbs": ["list", "watch"],
                           "resources": [{"group": "", "resources": ["pods"]}]},
                          {"level": "None"}]}


class KubeApiServer(ManagedProcess):
    name = "kube-apiserver"

    def __init__(self, workdir: Path, etcd_url: str, pki: Pki) -> None:
        super().__init__(workdir)
        self.log_path = workdir / "kube-apiserver.log"
        self.etcd_url = etcd_url
        self.pki = pki
        self.audit_policy = workdir / "audit-policy.yaml"
        self.audit_policy.write_text(json.dumps(AUDIT_POLICY))
        self.audit_log = workdir / "audit.log"

    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [str(kube_binary("kube-apiserver")),
                f"--bind-address={HOST}", f"--advertise-address={HOST}",
                f"--secure-port={self.port}", f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={self.pki.server_cert}",
                f"--tls-private-key-file={self.pki.server_key}",
                f"--client-ca-file={self.pki.ca_cert}",
                f"--etcd-servers={self.etcd_url}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={self.pki.service_account_pub}",
                f"--service-account-signing-key-file={self.pki.service_account_key}",
                "--authorization-mode=RBAC", "--allow-privileged=true",
                # `kubectl logs` reaches a real node's kubelet at its address: the
                # nodes' host names resolve nowhere (tests/support/realnode.py)
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # The `kubernetes` Service's endpoint would be this loopback address,
                # which Endpoints validation refuses; nothing in the tests dials it.
                "--endpoint-reconciler-type=none",
                f"--audit-policy-file={self.audit_policy}",
                f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                "--audit-log-maxsize=20", "--audit-log-maxbackup=1"]

    def audited(self, user: str, verb: str) -> int:
        """How many `verb` (list, watch) requests of pods `user` made, as the audit
        log has them (AUDIT_POLICY; a watch counted as it started)."""
        if not self.audit_log.exists():
            return 0
        # a watch's second record, as it ends, is not another request
        counted_stage = "ResponseStarted" if verb == "watch" else "ResponseComplete"
        count = 0
        for line in self.audit_log.read_text(errors="replace").splitlines():
            event = json.loads(line)
            if (event.get("verb"), event.get("stage"),
                    event.get("user", {}).get("username")) == (verb, counted_stage, user):
                count += 1
        return count


class KubeControllerManager(ManagedProcess):
    name = "kube-controller-manager"

    def __init__(self, workdir: Path, kubeconfig: Path, pki: Pki) -> None:
        super().__init__(workdir)
        self.log_path = workdir / "kube-controller-manager.log"
        self.kubeconfig = kubeconfig
        self.pki = pki

    def ports(self) -> list[int]:
        return []  # it serves nothing here; ControlPlane waits for its work instead

    def command(self) -> list[str]:
        return [str(kube_binary("kube-controller-manager")),
                f"--kubeconfig={self.kubeconfig}", f"--bind-address={HOST}",
                "--secure-port=0", "--leader-elect=false",
                f"--root-ca-file={self.pki.ca_cert}",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--cluster-signing-cert-file={self.pki.ca_cert}",
                f"--cluster-signing-key-file={self.pki.ca_key}"]


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager in `workdir`; `start()` returns
    once the API server is ready and the controller manager is doing its work."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.pki = make_pki(workdir / "pki")
        self.etcd = Etcd(workdir / "etcd")
        self.apiserver = KubeApiServer(workdir / "apiserver", self.etcd.url, self.pki)
        self.kubeconfig = workdir / "admin.kubeconfig"
        write_kubeconfig(self.kubeconfig, self.apiserver.url, self.pki)
        self.controller_manager = KubeControllerManager(
            workdir / "controller-manager", self.kubeconfig, self.pki)
        self._ssl = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        self._ssl.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))

    def processes(self) -> list[ManagedProcess]:
        return [self.etcd, self.apiserver, self.controller_manager]

    def start(self, timeout: float = 180.0) -> ControlPlane:
        deadline = time.monotonic() + timeout
        self.etcd.start(timeout)
        self.apiserver.start(timeout)
        self._wait(lambda: self.get("/readyz")[0] == 200, deadline, self.apiserver,
                   "kube-apiserver /readyz")
        self.controller_manager.start(timeout)
        # The service-account controller makes every namespace's `default` account,
        # which Pods need before they are admitted: the sign that controllers run.
        self._wait(lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default")[0]
                   == 200, deadline, self.controller_manager, "the default ServiceAccount")
        return self

    def stop(self) -> None:
        """SIGTERM each (SIGKILL if it does not exit), newest first."""
        for process in reversed(self.processes()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.stop(timeout=30)
            process.kill()

    def _wait(self, ready: Callable[[], bool], deadline: float, process: ManagedProcess,
              what: str) -> None:
        while time.monotonic() < deadline:
            if not process.alive():
                raise RuntimeError(f"{process.name} exited while waiting for {what}:\n"
                                   + process.log_tail())
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}:\n{process.log_tail()}")

    def get(self, path: str) -> tuple[int, Any]:
        """GET on the API server as the admin; (status, decoded JSON or text). A
        connection refused is status 0 (not up yet)."""
        request = urllib.request.Request(self.apiserver.url + path)
        try:
            with urllib.request.urlopen(request, context=self._ssl, timeout=10) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    def env(self) -> dict[str, str]:
        """Environment for kubectl and helm: this cluster, caches under workdir."""
        return {**tool_env(self.workdir), "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster; `check`: fail with its stderr."""
        return run_tool("kubectl", args, self.env(), input=input, check=check, timeout=timeout)

    def helm(self, *args: str, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_tool("helm", args, self.env(), check=check, timeout=timeout)


def tool_env(home: Path) -> dict[str, str]:
    """Environment for kubectl and helm with their caches and settings under `home`
    instead of the user's, and no cluster unless KUBECONFIG is added."""
    env = {**os.environ, "KUBECACHEDIR": str(home / "kube-cache"),
           "HELM_CACHE_HOME": str(home / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(home / "helm" / "config"),
           "HELM_DATA_HOME": str(home / "helm" / "data")}
    env.pop("KUBECONFIG", None)
    return env


def run_tool(name: str, args: Sequence[str], env: dict[str, str], *, input: str | None = None,
             check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run one of the built binaries; `check`: fail with its output on a non-zero exit."""
    result = subprocess.run([str(kube_binary(name)), *args], input=input, capture_output=True,
                            text=True, env=env, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} exited with "
                             f"{result.returncode}:\n{result.stderr}{result.stdout}")
    return result


@contextlib.contextmanager
def running_control_plane() -> Iterator[ControlPlane]:
    """A control plane in a fresh temporary folder; afterwards its processes are gone
    and so is the folder (etcd's data, keys and logs included)."""
    workdir = Path(tempfile.mkdtemp(prefix="stratamq-kube-"))
    plane = None
    try:
        plane = ControlPlane(workdir)
        yield plane.start()
    finally:
        if plane is not None:
            plane.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert plane is not None
    left = [process.name for process in plane.processes() if process.alive()]
    assert not left, f"still running after stop: {left}"


@contextlib.contextmanager
def refusing(plane: ControlPlane, namespace: str, rule: dict[str, Any], expression: str,
             probe: dict[str, Any], timeout: float = 60.0) -> Iterator[None]:
    """A real ValidatingAdmissionPolicy, bound to `namespace` alone, that refuses the
    requests `rule` (a resourceRule) matches where the CEL `expression` is false: in
    force from the start of the block (`probe`, a manifest it refuses, is tried by a
    server-side dry run until it is refused) to its end, when it is deleted (also on
    failure) and the probe is tried until the policy no longer answers it."""
    name = f"refuse-{namespace}"[:63].rstrip("-")
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [rule]},
                  "validations": [{"expression": expression,
                                   "message": "refused by the test"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1",
         "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {
                      "kubernetes.io/metadata.name": namespace}}}}}]))

    def in_force() -> bool:
        tried = plane.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-",
                              input=yaml.safe_dump(probe), check=False)
        return "ValidatingAdmissionPolicy" in tried.stderr

    try:
        wait_for("the admission policy to refuse", in_force, timeout)
        yield
    finally:
        plane.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy",
                      name, "--ignore-not-found")
    wait_for("the admission policy to go", lambda: not in_force(), timeout)
