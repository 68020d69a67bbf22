"""The operator reads each site's zone from its pod's node (issue 23): against a real
API server, pods of a storage on a labelled node, an unlabelled one, and none yet;
`kube.site_pods` gives each the zone of its node (read through `kube.NodeZones`), which
the replication controller plans by (`controller.seen_on`)."""

from __future__ import annotations

import yaml

from stratamq.operator import kube
from stratamq.operator.resources import Owner, site_selector_labels
from tests.support.kube import ControlPlane

NAME = "zoned"


def test_each_site_pod_is_in_its_nodes_zone(api: ControlPlane, namespace: str) -> None:
    nodes = {"zones-test-a": {"topology.kubernetes.io/zone": "zone-a"},
             "zones-test-plain": {}}
    for node, node_labels in nodes.items():
        api.kubectl("apply", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": node_labels}}))
    try:
        pods: dict[str, str | None] = {f"{NAME}-0": "zones-test-a",
                                       f"{NAME}-1": "zones-test-plain", f"{NAME}-2": None}
        for pod, on in pods.items():
            api.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "labels": site_selector_labels(NAME)},
                "spec": {**({"nodeName": on} if on else {}),
                         "containers": [{"name": "site", "image": "stratamq:test"}]}}))
        now = [0.0]
        zones = kube.NodeZones(clock=lambda: now[0])
        found = kube.site_pods(Owner(name=NAME, namespace=namespace, uid="u"), zones)
        assert {pod.name: pod.zone for pod in found} == {
            f"{NAME}-0": "zone-a", f"{NAME}-1": None, f"{NAME}-2": None}
        # A label that comes later is seen: a node without one is asked again, once
        # a minute (not at every round of every storage).
        api.kubectl("label", "node", "zones-test-plain", "topology.kubernetes.io/zone=zone-b")
        assert zones.of("zones-test-plain") is None
        now[0] += kube.NO_ZONE_RECHECK_SECONDS
        assert zones.of("zones-test-plain") == "zone-b"
        assert zones.of("no-such-node") is None
    finally:
        api.kubectl("delete", "node", *nodes, "--wait=false")
