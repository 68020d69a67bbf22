"""Fixtures of the tests on real nodes (tests/support/realnode.py): a real kubelet and
containerd per node running the images as containers. `real_kube_cluster` is one
Kubernetes cluster for the tests of this folder (it takes a minute or more to start);
they share it, each module in a namespace of its own. Its teardown leaves the host as
it was, also after a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import REPO
from tests.support.realnode import RealKubeCluster, missing_prerequisites

IMAGES = REPO / ".cache" / "images"
# Five: a storage scales 3 -> 5 sites, one per node (each binds its node's address).
NODES = 5


# Package scope: the nodes go right after the last test here, not at the session's end
# (five kubelets and containerds idling through the Spark and unit tests otherwise).
@pytest.fixture(scope="package")
def real_kube_cluster() -> Iterator[RealKubeCluster]:
    why = missing_prerequisites()
    if why and os.geteuid() != 0:
        pytest.skip(why)  # as the network-namespace tests: nothing `make` can install
    # the Debian packages are installed by `make test`: their absence is a failure
    assert why is None, why
    started = time.monotonic()
    # The images, built or found in the cache (seconds when nothing changed).
    subprocess.run([str(REPO / "images" / "build-local.sh"), str(IMAGES)], check=True,
                   timeout=1800)
    images_built = time.monotonic() - started
    workdir = Path(tempfile.mkdtemp(prefix="stratamq-realnode-"))
    cluster = RealKubeCluster(workdir, [IMAGES / "pause.tar", IMAGES / "stratamq.tar"], NODES)
    try:
        cluster.start()
        print(f"\nreal nodes: images {images_built:.0f} s, "
              f"cluster up {time.monotonic() - started - images_built:.0f} s")
        yield cluster
    finally:
        problems = cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not problems, f"host state not restored: {problems}"
        assert not workdir.exists(), f"{workdir} left"
