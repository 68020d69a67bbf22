"""Fixtures of the tests against a real Kubernetes API server (tests/support/kube.py).

`kube` is one control plane for the whole session: it takes seconds to start. Tests
share it, so each works in a namespace of its own (`namespace`) and names what it
creates after itself.

The operator modules (a storage run by real operator processes on the stand-in
kubelet) share `kube_cluster` (the control plane with their module's `NAMESPACE`,
peered for the operators' election), `node` (the stand-in kubelet serving it) and
`operators` (the operator processes; a module's `REAPPLY_INTERVAL`, when it sets
one, is theirs)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from harness.processes import REPO
from stratamq.operator import kube as operator_kube
from tests.support.kube import ControlPlane, running_control_plane
from tests.support.kubelet import Kubelet, running_kubelet
from tests.support.operator_process import Operators, peered_namespace, running_operators

CRDS = REPO / "crds"
CRD_NAMES = ["durablestorages.stratamq.io", "replicatransitions.stratamq.io"]
# Kopf's peering resources, which the operator's leader election uses.
PEERING_CRD_NAMES = ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]


@pytest.fixture(scope="session")
def kube() -> Iterator[ControlPlane]:
    with running_control_plane() as plane:
        yield plane


@pytest.fixture(scope="session")
def crds(kube: ControlPlane) -> ControlPlane:
    """The control plane with the CRDs of crds/ applied and Established."""
    kube.kubectl("apply", "-f", str(CRDS))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 *(f"crd/{name}" for name in CRD_NAMES + PEERING_CRD_NAMES))
    return kube


@pytest.fixture
def namespace(kube: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace for this test alone, deleted (without waiting) afterwards."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50].strip("-")
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="module")
def kube_cluster(crds: ControlPlane, request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """The module's namespace (its `NAMESPACE`), with the operators' peering object."""
    with peered_namespace(crds, request.module.NAMESPACE) as made:
        yield made


@pytest.fixture(scope="module")
def node(kube_cluster: ControlPlane, request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubelet]:
    with running_kubelet(kube_cluster, tmp_path_factory.mktemp("node"),
                         {request.module.NAMESPACE}) as kubelet:
        yield kubelet
    assert not kubelet.errors, kubelet.errors


@pytest.fixture(scope="module")
def operators(kube_cluster: ControlPlane, node: Kubelet, request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operators]:
    options = ({"reapply_interval": request.module.REAPPLY_INTERVAL}
               if hasattr(request.module, "REAPPLY_INTERVAL") else {})
    with running_operators(kube_cluster, tmp_path_factory.mktemp("operator"),
                           request.module.NAMESPACE, **options) as made:
        yield made


@pytest.fixture
def api(crds: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlPlane]:
    """The operator's API calls (stratamq.operator.kube) made from the test's own
    process, to the test's API server."""
    # The client reads KUBECONFIG when it is imported: its default is set instead.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION",
                        str(crds.kubeconfig))
    operator_kube.api_client.cache_clear()
    operator_kube.dynamic.cache_clear()
    yield crds
    operator_kube.api_client.cache_clear()
    operator_kube.dynamic.cache_clear()
