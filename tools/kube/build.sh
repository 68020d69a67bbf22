#!/usr/bin/env bash
# Builds the Kubernetes test binaries from source with the Go toolchain, through the Go
# module proxy, into a cache folder (default .cache/bin):
#   etcd                                          tools/kube/etcd
#   kube-apiserver, kube-controller-manager, kubectl,
#   kubelet, kube-scheduler (the real-node tests)   tools/kube/kubernetes
#   helm                                          tools/kube/helm
# Each folder is a small Go module whose go.mod/go.sum pin the versions. A group is
# rebuilt only when its binaries are missing or its go.mod/go.sum (or this script)
# changed since they were built (the pin's checksum is kept beside them). Go is for test infrastructure
# only: nothing the broker ships is built here.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
bin_dir="$(mkdir -p "${1:-$here/../../.cache/bin}" && cd "${1:-$here/../../.cache/bin}" && pwd)"

if ! command -v go >/dev/null; then
  echo "kube-bin: the Go toolchain (go 1.24 or newer) is needed to build the" \
       "Kubernetes test binaries; put 'go' on PATH" >&2
  exit 1
fi

# Versions reported by the binaries (kubectl version, /version); the module versions
# themselves come from go.mod.
module_version() {  # module_version GROUP MODULE: the version GROUP's go.mod pins
  (cd "$here/$1" && go list -mod=readonly -m -f '{{.Version}}' "$2")
}
kube_version="$(module_version kubernetes k8s.io/kubernetes)"
kube_minor="$(echo "$kube_version" | cut -d. -f2)"
helm_version="$(module_version helm helm.sh/helm/v3)"
# The Kubernetes version helm assumes without a cluster (helm template, helm lint's
# deprecation checks): that of the client-go it is built with, as helm's Makefile does.
helm_kube_minor="$(module_version helm k8s.io/client-go | cut -d. -f2)"
kube_ldflags="-s -w
  -X k8s.io/component-base/version.gitVersion=$kube_version
  -X k8s.io/component-base/version.gitMajor=1
  -X k8s.io/component-base/version.gitMinor=$kube_minor
  -X k8s.io/component-base/version.gitTreeState=clean
  -X k8s.io/client-go/pkg/version.gitVersion=$kube_version
  -X k8s.io/client-go/pkg/version.gitMajor=1
  -X k8s.io/client-go/pkg/version.gitMinor=$kube_minor"
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$helm_kube_minor
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$helm_kube_minor"

# build GROUP LDFLAGS NAME=PACKAGE...
build() {
  local group="$1" ldflags="$2"
  shift 2
  local pin stamp="$bin_dir/.$group.pin" missing=""
  # The pin: the group's versions and this script (its flags change the binaries too).
  pin="$(cd "$here/$group" && cat go.mod go.sum "$here/build.sh" | sha256sum | cut -d' ' -f1)"
  for spec in "$@"; do
    [ -x "$bin_dir/${spec%%=*}" ] || missing=1
  done
  if [ -z "$missing" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$pin" ]; then
    echo "kube-bin: $group binaries are up to date in $bin_dir"
    return
  fi
  local start=$SECONDS
  echo "kube-bin: building $group ($*) ..."
  rm -f "$stamp"
  for spec in "$@"; do
    # -mod=readonly: go.sum must already pin everything (no silent upgrades).
    (cd "$here/$group" && CGO_ENABLED=0 go build -mod=readonly -trimpath -buildvcs=false \
      -ldflags "$ldflags" -o "$bin_dir/${spec%%=*}" "${spec#*=}")
  done
  echo "$pin" > "$stamp"
  echo "kube-bin: built $group in $((SECONDS - start)) s"
}

build etcd "-s -w" etcd=go.etcd.io/etcd/server/v3
build kubernetes "$kube_ldflags" \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kubectl=k8s.io/kubernetes/cmd/kubectl \
  kubelet=k8s.io/kubernetes/cmd/kubelet \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler
build helm "$helm_ldflags" helm=helm.sh/helm/v3/cmd/helm
