#!/usr/bin/env bash
# Builds the images the real-node tests run (tests/support/realnode.py) on a machine
# without access to an image registry, as Docker archives under a cache folder
# (default .cache/images):
#   stratamq.tar   stratamq/stratamq:<chart appVersion>   images/stratamq/Dockerfile,
#                  unchanged, on a local Debian bookworm base with Python 3.11
#   pause.tar      local/pause:3.10                        the Kubernetes pause
#                  container, built from pause.c of the pinned k8s.io/kubernetes module
# and with --spark also
#   spark.tar      stratamq/stratamq-spark:<chart appVersion>   images/spark/Dockerfile,
#                  unchanged, on the same base (Spark from the pyspark wheel)
#
#   images/build-local.sh [--spark] [CACHE]
# The base is made with `debootstrap --variant=minbase bookworm` from the Debian mirror
# apt already uses; packages (apt, PyPI) are the only downloads. Users building for a
# registry keep the Dockerfile's default base (python:3.11-slim-bookworm).
#
# Cached: each archive is rebuilt only when its inputs changed (the Dockerfile, the
# files it copies, this script; the pause source), so a second run costs nothing.
#
# Needs root, debootstrap, gcc with a static libc, and Docker (`docker.io` on Debian).
# When no Docker daemon answers, one is started for the build with its data under the
# cache folder, without iptables rules or a bridge (builds use the host network), and
# stopped again at the end.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
with_spark=""
if [ "${1:-}" = --spark ]; then with_spark=1; shift; fi
cache="$(mkdir -p "${1:-$repo/.cache/images}" && cd "${1:-$repo/.cache/images}" && pwd -P)"
tag="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$repo/charts/stratamq/Chart.yaml")"
image="stratamq/stratamq:$tag"
spark_image="stratamq/stratamq-spark:$tag"
minbase="local/debian-python:bookworm-minbase"
base="local/python:3.11-bookworm"
pause_image="local/pause:3.10"
say() { echo "build-local: $*"; }

for command in debootstrap gcc docker dockerd go; do
  command -v "$command" >/dev/null || {
    echo "build-local: '$command' is needed (Debian: debootstrap gcc docker.io golang)" >&2
    exit 1
  }
done

# The inputs of an archive, as one checksum.
pin_of() {  # pin_of IMAGE_FOLDER
  (cd "$repo" && {
    find "$1" broker operator spark config pyproject.toml README.md -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum
    sha256sum images/build-local.sh
  } | sha256sum | cut -d' ' -f1)
}
stratamq_pin="$(pin_of images/stratamq)"
spark_pin="$(pin_of images/spark)"
pause_source="$(cd "$repo/tools/kube/kubernetes" \
  && go list -mod=readonly -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
pause_pin="$(cat "$pause_source" "$repo/images/build-local.sh" | sha256sum | cut -d' ' -f1)"
up_to_date() {  # up_to_date NAME PIN
  [ -s "$cache/$1.tar" ] && [ "$(cat "$cache/.$1.pin" 2>/dev/null)" = "$2" ]
}
spark_wanted() {  # asked for and not up to date
  [ -n "$with_spark" ] && ! up_to_date spark "$spark_pin"
}
if up_to_date stratamq "$stratamq_pin" && up_to_date pause "$pause_pin" && ! spark_wanted; then
  say "images are up to date in $cache"
  exit 0
fi

# A Docker daemon: the one running, or our own for this build.
own_daemon=""
# What the daemon makes on the host outside its roots; removed again unless it was there.
daemon_leftovers=""
for path in /run/containerd /run/docker /opt/containerd /etc/docker/key.json; do
  [ -e "$path" ] || daemon_leftovers="$daemon_leftovers $path"
done
stop_daemon() {
  [ -n "$own_daemon" ] || return 0
  kill "$own_daemon" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$own_daemon" 2>/dev/null || break; sleep 0.2; done
  # What the daemon leaves on the host: its network namespace mount, (empty) cgroups.
  for point in $(awk -v root="$cache/docker/exec" 'index($5, root) == 1 { print $5 }' \
      /proc/self/mountinfo | sort -r); do
    umount -l "$point" || true
  done
  for group in /sys/fs/cgroup/*/docker; do rmdir "$group" 2>/dev/null || true; done
  for path in $daemon_leftovers; do rm -rf "$path"; done
}
trap stop_daemon EXIT
if ! docker info >/dev/null 2>&1; then
  say "starting a Docker daemon in $cache/docker"
  mkdir -p "$cache/docker"
  nice dockerd --iptables=false --ip-masq=false --bridge=none \
    --data-root "$cache/docker/data" --exec-root "$cache/docker/exec" \
    --pidfile "$cache/docker/dockerd.pid" --host "unix://$cache/docker/docker.sock" \
    >"$cache/docker/dockerd.log" 2>&1 &
  own_daemon=$!
  export DOCKER_HOST="unix://$cache/docker/docker.sock"
  for _ in $(seq 1 150); do docker info >/dev/null 2>&1 && break; sleep 0.2; done
  docker info >/dev/null 2>&1 || {
    echo "build-local: dockerd did not start:" >&2; tail -20 "$cache/docker/dockerd.log" >&2
    exit 1
  }
fi
# The classic builder: it needs no buildx plugin.
export DOCKER_BUILDKIT=0

make_base() {  # the local base of both Python images, as $base
  if ! docker image inspect "$minbase" >/dev/null 2>&1; then
    mirror="$(sed -n 's/^URIs: *\(.*debian\)\/\{0,1\}$/\1/p' /etc/apt/sources.list.d/*.sources \
      2>/dev/null | grep -v security | head -1)"
    mirror="${mirror:-$(sed -n 's/^deb \(http[^ ]*debian\)\/\{0,1\} bookworm .*/\1/p' \
      /etc/apt/sources.list 2>/dev/null | head -1)}"
    mirror="${mirror:-http://deb.debian.org/debian}"
    say "making $minbase with debootstrap from $mirror"
    rootfs="$cache/rootfs"
    rm -rf "$rootfs"
    nice debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3 \
      bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
        tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import --change 'CMD ["python3"]' - "$minbase" >/dev/null
    rm -rf "$rootfs"
  fi
  # The base: the minimal system trusting what this machine trusts (its own CAs, e.g.
  # of a proxy that intercepts TLS), for pip in the build. Rebuilt each time (seconds).
  context="$cache/base-context"
  rm -rf "$context" && mkdir -p "$context/ca"
  cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$context/pip.conf"
  printf '%s\n' "FROM $minbase" "COPY ca/ /usr/local/share/ca-certificates/" \
    "COPY pip.conf /etc/pip.conf" "RUN update-ca-certificates >/dev/null" \
    >"$context/Dockerfile"
  docker build --network host -t "$base" "$context" >"$cache/base-build.log" 2>&1 || {
    tail -20 "$cache/base-build.log" >&2; exit 1; }
  rm -rf "$context"
}
base_made=""
build_image() {  # build_image NAME TAG PIN: images/NAME/Dockerfile on the base, as NAME.tar
  local name=$1 tag=$2 pin=$3 start=$SECONDS
  [ -n "$base_made" ] || { make_base; base_made=1; }
  say "building $tag"
  (cd "$repo" && nice docker build --network host --build-arg "PYTHON_IMAGE=$base" \
    -f "images/$name/Dockerfile" -t "$tag" . >"$cache/$name-build.log" 2>&1) || {
      tail -30 "$cache/$name-build.log" >&2; exit 1; }
  docker save "$tag" >"$cache/$name.tar.part"
  mv "$cache/$name.tar.part" "$cache/$name.tar"
  echo "$pin" >"$cache/.$name.pin"
  say "built $tag in $((SECONDS - start)) s ($(du -h "$cache/$name.tar" | cut -f1))"
}

up_to_date stratamq "$stratamq_pin" || build_image stratamq "$image" "$stratamq_pin"
if spark_wanted; then
  build_image spark "$spark_image" "$spark_pin"
fi

if ! up_to_date pause "$pause_pin"; then
  rootfs="$cache/pause-rootfs"
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  gcc -Os -static -DVERSION=v3.10-local "$pause_source" -o "$rootfs/pause"
  tar -C "$rootfs" -c . | docker import --change 'ENTRYPOINT ["/pause"]' - "$pause_image" \
    >/dev/null
  rm -rf "$rootfs"
  docker save "$pause_image" >"$cache/pause.tar.part"
  mv "$cache/pause.tar.part" "$cache/pause.tar"
  echo "$pause_pin" >"$cache/.pause.pin"
  say "built $pause_image"
fi
