#!/usr/bin/env bash
# The operator's replication scenario on whatever cluster kubectl and helm point at
# (KUBECONFIG), with the image already there: `make kind-e2e` runs it on a kind
# cluster (tools/kind/e2e.sh), and tests/realnode/test_scenario_on_real_nodes.py on
# the test suite's real nodes.
#
#   tools/kind/scenario.sh [STEP...]    (default: install scale delete-pod)
#
# install     `helm install` of the chart (operator, CRDs), `kubectl apply` of a
#             DurableStorage of 3 sites, replication factor 3; wait until it is Ready
# scale       3 -> 5 -> 3: ReplicaTransitions appear and reach Done; the StatefulSet
#             shrinks back to 3 only after the departing pods hold nothing
# delete-pod  delete the pod leading shard 0: the shard's leadership moves (handed
#             over as it stops) and the pod comes back (a new uid); then Ready again.
#             Ready alone would pass at once, before anything happened.
# uninstall   `helm uninstall --wait` (the storage first), the namespaces deleted
#
# Environment: NS (the storage's namespace, stratamq-e2e), RELEASE (stratamq),
# OPERATOR_NS (stratamq-system), HELM_ARGS (more `helm install` arguments, split on
# spaces), STORAGE_SPEC (more fields of the storage's spec, as YAML flow, e.g.
# "hostNetwork: true"), WAIT_S (seconds each wait may take, 600).
set -euo pipefail

NS=${NS:-stratamq-e2e}
RELEASE=${RELEASE:-stratamq}
OPERATOR_NS=${OPERATOR_NS:-stratamq-system}
WAIT_S=${WAIT_S:-600}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

say() { echo "scenario: $*"; }

wait_phase() {  # wait_phase PHASE SITES
    local deadline=$((SECONDS + WAIT_S))
    until [[ "$(kubectl -n "$NS" get durablestorage mq \
                -o jsonpath='{.status.phase}/{.status.readyReplicas}')" == "$1/$2" ]]; do
        (( SECONDS < deadline )) || { kubectl -n "$NS" get durablestorage,rt,pods; exit 1; }
        sleep 2
    done
}

install() {
    # shellcheck disable=SC2086  # HELM_ARGS: several arguments
    helm install "$RELEASE" "$ROOT/charts/stratamq" --namespace "$OPERATOR_NS" \
        --create-namespace --wait ${HELM_ARGS:-}
    kubectl create namespace "$NS"
    kubectl -n "$NS" apply -f - <<YAML
apiVersion: stratamq.io/v1alpha1
kind: DurableStorage
metadata: {name: mq}
spec: {sites: 3, messages: {nShards: 4, replicationFactor: 3}, storage: {size: 1Gi}${STORAGE_SPEC:+, $STORAGE_SPEC}}
YAML
    wait_phase Ready 3
    say "installed, Ready with 3 sites"
}

scale() {
    kubectl -n "$NS" scale durablestorage mq --replicas=5
    wait_phase Ready 5
    kubectl -n "$NS" get replicatransitions
    [[ -z "$(kubectl -n "$NS" get rt -o jsonpath='{.items[?(@.status.phase!="Done")].metadata.name}')" ]]
    kubectl -n "$NS" scale durablestorage mq --replicas=3
    wait_phase Ready 3
    [[ "$(kubectl -n "$NS" get statefulset mq -o jsonpath='{.spec.replicas}')" == 3 ]]
    kubectl -n "$NS" get replicatransitions
    say "scaled 3 -> 5 -> 3"
}

delete_pod() {
    local shard0='{.status.databases[0].shards[0]' leader epoch pod uid deadline
    shard0_field() { kubectl -n "$NS" get durablestorage mq -o jsonpath="$shard0.$1}"; }
    pod_uid() { kubectl -n "$NS" get pod "$pod" -o jsonpath='{.metadata.uid}' 2>/dev/null || true; }
    leader=$(shard0_field leader)
    epoch=$(shard0_field leaderEpoch)
    pod=$(kubectl -n "$NS" get durablestorage mq \
        -o jsonpath="{.status.sites[?(@.id==\"$leader\")].pod}")
    uid=$(pod_uid)
    say "deleting $pod, leader of shard 0 at epoch $epoch"
    kubectl -n "$NS" delete pod "$pod" --wait=false
    # Ready alone passes at once (nothing has happened yet): wait for the shard's
    # leadership to move (handed over while the pod stops), then for the pod back as a
    # new one.
    deadline=$((SECONDS + WAIT_S))
    until [[ "$(shard0_field leader)" != "$leader" && "$(shard0_field leaderEpoch)" -gt "$epoch" ]]; do
        (( SECONDS < deadline )) || {
            say "shard 0 still led by $leader at epoch $epoch after ${WAIT_S} s"
            kubectl -n "$NS" get durablestorage mq -o yaml; exit 1; }
        sleep 1
    done
    until [[ -n "$(pod_uid)" && "$(pod_uid)" != "$uid" ]]; do
        (( SECONDS < deadline )) || { kubectl -n "$NS" get pods; exit 1; }
        sleep 1
    done
    wait_phase Ready 3
    kubectl -n "$NS" get durablestorage mq -o wide
    say "shard 0 moved off $pod, which is back"
}

uninstall() {
    kubectl -n "$NS" delete durablestorage mq --wait=true --timeout="${WAIT_S}s"
    helm uninstall "$RELEASE" --namespace "$OPERATOR_NS" --wait --timeout="${WAIT_S}s"
    kubectl delete namespace "$NS" "$OPERATOR_NS" --wait=true --timeout="${WAIT_S}s"
    say "uninstalled"
}

(( $# )) || set -- install scale delete-pod
for step in "$@"; do
    case "$step" in
        install) install ;;
        scale) scale ;;
        delete-pod) delete_pod ;;
        uninstall) uninstall ;;
        *) echo "scenario: unknown step '$step' (install, scale, delete-pod, uninstall)" >&2
           exit 2 ;;
    esac
done
say "passed: $*"
