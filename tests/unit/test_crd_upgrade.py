"""The CRD upgrade hook's decision (`stratamq.operator.crd_upgrade.decide`), pure: what
it writes over what the cluster has. The hook against a real API server:
tests/kube/test_chart_crd_upgrade.py."""

from __future__ import annotations

from typing import Any

from stratamq.operator.crd_upgrade import (
    DIGEST_ANNOTATION,
    VERSION_ANNOTATION,
    decide,
    spec_digest,
    version_key,
)

WANTED: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "things.example.io", "labels": {"chart": "yes"}},
    "spec": {"group": "example.io", "versions": [{"name": "v1"}]}}


def found(version: str | None, spec: dict[str, Any] | None = None,
          digest: str | None = None) -> dict[str, Any]:
    annotations = {"theirs": "kept"}
    if version is not None:
        annotations[VERSION_ANNOTATION] = version
        annotations[DIGEST_ANNOTATION] = digest or spec_digest(WANTED["spec"])
    return {"apiVersion": WANTED["apiVersion"], "kind": WANTED["kind"],
            "metadata": {"name": "things.example.io", "resourceVersion": "7",
                         "labels": {"theirs": "kept"}, "annotations": annotations,
                         "managedFields": [{"manager": "helm"}]},
            "spec": spec or {"group": "example.io", "versions": [{"name": "v0"}],
                             "conversion": {"strategy": "None"}},
            "status": {"storedVersions": ["v1"]}}


def test_versions_order_by_their_numbers() -> None:
    assert version_key("0.10.1") > version_key("0.9.3")
    assert version_key("1.2.0-rc.1") == version_key("1.2.0")


def test_a_missing_crd_is_made_stamped() -> None:
    action, body = decide(WANTED, None, "0.2.0")
    assert action == "created" and body is not None
    assert body["spec"] == WANTED["spec"]
    assert body["metadata"]["annotations"] == {
        VERSION_ANNOTATION: "0.2.0", DIGEST_ANNOTATION: spec_digest(WANTED["spec"])}


def test_an_older_or_unstamped_crd_gets_the_charts_spec_and_keeps_its_metadata() -> None:
    for version in (None, "0.1.0"):
        action, body = decide(WANTED, found(version), "0.2.0")
        assert action == "updated" and body is not None
        assert body["spec"] == WANTED["spec"]  # whole: the cluster's extra keys go
        metadata = body["metadata"]
        assert metadata["resourceVersion"] == "7"  # a conditional write
        assert metadata["labels"] == {"theirs": "kept", "chart": "yes"}
        assert metadata["annotations"]["theirs"] == "kept"
        assert metadata["annotations"][VERSION_ANNOTATION] == "0.2.0"
        assert "managedFields" not in metadata and "status" not in body


def test_the_same_chart_writes_nothing_and_a_changed_spec_at_one_version_is_written() -> None:
    assert decide(WANTED, found("0.2.0"), "0.2.0") == ("unchanged", None)
    action, _ = decide(WANTED, found("0.2.0", digest="another"), "0.2.0")
    assert action == "updated"


def test_a_crd_of_a_newer_chart_is_kept() -> None:
    assert decide(WANTED, found("0.10.0"), "0.9.0") == ("kept", None)
