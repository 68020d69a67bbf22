#!/usr/bin/env bash
# `make kind-e2e`: the operator's replication scenario (tools/kind/scenario.sh:
# install, scale 3 -> 5 -> 3, delete a leader's pod) on a cluster made by kind, with
# the pod network, cluster DNS and kube-proxy the real-node tests lack. Needs docker,
# kind, kubectl and helm on PATH. kind needs its node image from a registry, which
# the machines this project is built on cannot reach: the kind part has never run
# there; the scenario's steps run on real nodes in `make test`.
#
# KEEP=1 keeps the cluster afterwards.
set -euo pipefail

CLUSTER=${CLUSTER:-stratamq-e2e}
IMAGE=stratamq/stratamq:0.1.0
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

cleanup() { [[ "${KEEP:-0}" == 1 ]] || kind delete cluster --name "$CLUSTER"; }
trap cleanup EXIT

kind create cluster --name "$CLUSTER"
docker build -f "$ROOT/images/stratamq/Dockerfile" -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER"
# The steps themselves run on real nodes in `make test` too
# (tests/realnode/test_scenario_on_real_nodes.py).
"$ROOT/tools/kind/scenario.sh" install scale delete-pod
echo "kind-e2e: passed"
