#!/usr/bin/env bash
# `make kind-e2e`: the operator's replication scenario of tests/kube/ on a real
# cluster made by kind (a kubelet, cluster DNS, kube-proxy: what the test control
# plane plays or lacks). Needs docker, kind, kubectl and helm on PATH. It cannot run
# on the machines this project is built on (no Docker there), so it has never run:
# treat it as the documented steps, to be checked on a machine with Docker.
#
# 1. a kind cluster; the broker/operator image built and loaded into it;
# 2. `helm install` of the chart (operator, CRDs), `kubectl apply` of a DurableStorage
#    of 3 sites, replication factor 3; wait until it is Ready;
# 3. scale 3 -> 5 -> 3: ReplicaTransitions appear and reach Done; the StatefulSet
#    shrinks back to 3 only after the departing pods hold nothing;
# 4. delete a pod leading a shard: its leadership moves (handed over as it stops), the
#    pod comes back (a new uid) and the storage is Ready again.
# KEEP=1 keeps the cluster afterwards.
set -euo pipefail

CLUSTER=${CLUSTER:-stratamq-e2e}
IMAGE=stratamq/stratamq:0.1.0
NS=stratamq-e2e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

cleanup() { [[ "${KEEP:-0}" == 1 ]] || kind delete cluster --name "$CLUSTER"; }
trap cleanup EXIT

wait_phase() {  # wait_phase PHASE SITES TIMEOUT
    local deadline=$((SECONDS + $3))
    until [[ "$(kubectl -n "$NS" get durablestorage mq \
                -o jsonpath='{.status.phase}/{.status.readyReplicas}')" == "$1/$2" ]]; do
        (( SECONDS < deadline )) || { kubectl -n "$NS" get durablestorage,rt,pods; exit 1; }
        sleep 2
    done
}

kind create cluster --name "$CLUSTER"
docker build -f "$ROOT/images/stratamq/Dockerfile" -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER"
helm install stratamq "$ROOT/charts/stratamq" --namespace stratamq-system --create-namespace \
    --wait
kubectl create namespace "$NS"
kubectl -n "$NS" apply -f - <<YAML
apiVersion: stratamq.io/v1alpha1
kind: DurableStorage
metadata: {name: mq}
spec: {sites: 3, messages: {nShards: 4, replicationFactor: 3}, storage: {size: 1Gi}}
YAML
wait_phase Ready 3 600

kubectl -n "$NS" scale durablestorage mq --replicas=5
wait_phase Ready 5 600
kubectl -n "$NS" get replicatransitions
[[ -z "$(kubectl -n "$NS" get rt -o jsonpath='{.items[?(@.status.phase!="Done")].metadata.name}')" ]]

kubectl -n "$NS" scale durablestorage mq --replicas=3
wait_phase Ready 3 600
[[ "$(kubectl -n "$NS" get statefulset mq -o jsonpath='{.spec.replicas}')" == 3 ]]
kubectl -n "$NS" get replicatransitions

shard0='{.status.databases[0].shards[0]'
shard0_field() { kubectl -n "$NS" get durablestorage mq -o jsonpath="$shard0.$1}"; }
pod_uid() { kubectl -n "$NS" get pod "$pod" -o jsonpath='{.metadata.uid}' 2>/dev/null || true; }
leader=$(shard0_field leader)
epoch=$(shard0_field leaderEpoch)
pod=$(kubectl -n "$NS" get durablestorage mq \
    -o jsonpath="{.status.sites[?(@.id==\"$leader\")].pod}")
uid=$(pod_uid)
kubectl -n "$NS" delete pod "$pod" --wait=false
# Ready alone passes at once (nothing has happened yet): wait for the shard's leadership
# to move (handed over while the pod stops), then for the pod back as a new one.
deadline=$((SECONDS + 120))
until [[ "$(shard0_field leader)" != "$leader" && "$(shard0_field leaderEpoch)" -gt "$epoch" ]]; do
    (( SECONDS < deadline )) || { kubectl -n "$NS" get durablestorage mq -o yaml; exit 1; }
    sleep 1
done
until [[ -n "$(pod_uid)" && "$(pod_uid)" != "$uid" ]]; do
    (( SECONDS < deadline )) || { kubectl -n "$NS" get pods; exit 1; }
    sleep 1
done
wait_phase Ready 3 600
kubectl -n "$NS" get durablestorage mq -o wide
echo "kind-e2e: passed"
