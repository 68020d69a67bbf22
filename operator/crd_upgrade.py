"""The chart's pre-upgrade hook: bring the cluster's CustomResourceDefinitions to those
of the chart being installed (`python -m stratamq.operator.crd_upgrade`).

Helm installs a chart's `crds/` at the first install only and never touches them on an
upgrade. A new chart's operator would then write fields that the old CRDs do not know,
and the API server prunes unknown fields from every object it stores: a setting of the
new version silently gone. The hook (charts/stratamq/templates/crd-upgrade-hook.yaml)
runs before the upgrade applies anything, with the chart's `crds/` mounted from a
ConfigMap, and replaces each CRD's spec with the chart's.

It never downgrades. Each CRD it writes is stamped with the chart's version; a CRD
stamped by a newer chart is left as it is (a rollback, an older chart installed over a
newer one): the older operator ignores the fields it does not know, while taking them
out of the schema would make the API server prune them from the stored objects.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from . import kube

log = logging.getLogger(__name__)

CRD_API_VERSION = "apiextensions.k8s.io/v1"
CRD_KIND = "CustomResourceDefinition"
# The chart version that last wrote a CRD, and a digest of the spec it wrote (the API
# server fills in defaults, so the stored spec never equals the chart's).
VERSION_ANNOTATION = "stratamq.io/chart-version"
DIGEST_ANNOTATION = "stratamq.io/crd-digest"
# Tries of a replace that met a concurrent write (the resourceVersion moved on).
REPLACE_TRIES = 5


@dataclass(frozen=True)
class Outcome:
    """What became of one CRD: `action` is created, updated, unchanged or kept."""

    name: str
    action: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.name}: {self.action}" + (f" ({self.detail})" if self.detail else "")


def version_key(version: str) -> tuple[int, ...]:
    """`version`'s numbers, for ordering ("0.10.1" after "0.9.3"); a pre-release suffix
    orders with its release."""
    return tuple(int(number) for number in re.findall(r"\d+", version.split("-")[0]))


def spec_digest(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def chart_crds(folder: Path) -> Iterator[dict[str, Any]]:
    """The CRD manifests in `folder`'s YAML files, in the files' name order."""
    for path in sorted(folder.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == CRD_KIND:
                yield document


def decide(wanted: dict[str, Any], found: dict[str, Any] | None, chart_version: str
           ) -> tuple[str, dict[str, Any] | None]:
    """What to do with the CRD `wanted` (the chart's) when the cluster has `found` (None:
    none): the action and the object to write (None: nothing to write). Pure."""
    stamps = {VERSION_ANNOTATION: chart_version, DIGEST_ANNOTATION: spec_digest(wanted["spec"])}
    stamped = {**wanted, "metadata": {**wanted["metadata"], "annotations": {
        **(wanted["metadata"].get("annotations") or {}), **stamps}}}
    if found is None:
        return "created", stamped
    metadata = found["metadata"]
    annotations = metadata.get("annotations") or {}
    theirs = annotations.get(VERSION_ANNOTATION)
    if theirs is not None and version_key(theirs) > version_key(chart_version):
        return "kept", None
    if all(annotations.get(key) == value for key, value in stamps.items()):
        return "unchanged", None
    # The whole spec is the chart's (a field the new chart dropped goes too); the
    # metadata is the cluster's, with the chart's labels and annotations over it.
    replacement = {**found, "spec": wanted["spec"], "metadata": {
        **metadata,
        "labels": {**(metadata.get("labels") or {}),
                   **(wanted["metadata"].get("labels") or {})},
        "annotations": {**(metadata.get("annotations") or {}),
                        **stamped["metadata"]["annotations"]}}}
    replacement.pop("status", None)
    replacement["metadata"].pop("managedFields", None)
    return "updated", replacement


def upgrade_crd(wanted: dict[str, Any], chart_version: str) -> Outcome:
    """Bring one CRD to `wanted`, as `decide` says; a replace that meets a concurrent
    write is decided again on what is there now."""
    name = wanted["metadata"]["name"]
    for _ in range(REPLACE_TRIES):
        found = kube.get(CRD_API_VERSION, CRD_KIND, None, name)
        action, body = decide(wanted, found, chart_version)
        theirs = None if found is None else (
            (found["metadata"].get("annotations") or {}).get(VERSION_ANNOTATION))
        if body is None:
            detail = f"written by chart {theirs}, newer than {chart_version}" \
                if action == "kept" else ""
            return Outcome(name, action, detail)
        written = kube.create(body) if found is None else kube.replace(body)
        if not written:  # written meanwhile (or made, when it was missing): again
            continue
        detail = f"chart {theirs or 'unknown'} -> {chart_version}" \
            if action == "updated" else f"chart {chart_version}"
        return Outcome(name, action, detail)
    raise TimeoutError(f"{name}: still written by others after {REPLACE_TRIES} tries")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stratamq.operator.crd_upgrade",
        description="Bring the cluster's CRDs to a chart's crds/ before `helm upgrade` "
                    "(the chart's pre-upgrade hook); a CRD written by a newer chart is "
                    "left as it is.")
    parser.add_argument("--crds", type=Path, required=True,
                        help="the folder of the chart's CRD manifests (*.yaml)")
    parser.add_argument("--chart-version", required=True,
                        help="the version of the chart being installed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.crds.is_dir():
        print(f"error: no folder {args.crds}", file=sys.stderr)
        return 2
    wanted = list(chart_crds(args.crds))
    if not wanted:
        print(f"error: no CustomResourceDefinition in {args.crds}/*.yaml", file=sys.stderr)
        return 2
    try:
        for crd in wanted:
            log.info("%s", upgrade_crd(crd, args.chart_version).line())
    except (ApiException, ConfigException, urllib3.exceptions.HTTPError,
            TimeoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
