#!/usr/bin/env bash
# Puts a real kube-apiserver and etcd on this machine for the Kubernetes tests (tests/kubeapi.py),
# and prints where they are (`--where`: only where the kube-apiserver belongs, building nothing).
# Idempotent: a cached kube-apiserver is reused, so only a cold machine pays for the Go build
# (about 7 minutes on 2 busy cores, plus the module download on a machine without Go's cache).
#
# kube-apiserver is built from the published Kubernetes Go modules (tools/kube/, version pinned
# in its go.mod) because this machine reaches the Go module proxy but no download site. The
# binary is cached under ${BERTH_KUBE_CACHE:-~/.cache/berth/kube}/<version>-<hash>/, where the
# hash covers tools/kube/{go.mod,go.sum,main.go}: a changed pin builds anew, never a stale binary.
# tests/kubeapi.py computes the same path (keep the two in step).
#
# etcd comes from Debian's etcd-server package (3.4.23). Kubernetes 1.35 still runs on it: its
# feature check finds no RequestWatchProgress in etcd 3.4 and serves consistent lists from etcd
# instead of its watch cache, which only costs speed. A Kubernetes that refuses etcd 3.4 would
# need etcd built from go.etcd.io/etcd/server/v3 too (its etcdmain package, same cache).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
src="$root/tools/kube"
export PATH="/usr/local/go/bin:$PATH"
# The go directive in go.mod is met by the installed Go; never let Go fetch a toolchain.
export GOTOOLCHAIN=local

# The version of k8s.io/kubernetes that go.mod requires (inside or outside a require block).
version=$(awk '$0 !~ /=>|^[[:space:]]*\/\// {
  for (i = 1; i < NF; i++) if ($i == "k8s.io/kubernetes") { print $(i + 1); exit }
}' "$src/go.mod")
if [[ -z "$version" ]]; then
  echo "build-kube: no requirement of k8s.io/kubernetes in $src/go.mod" >&2
  exit 1
fi
hash=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)
cache="${BERTH_KUBE_CACHE:-$HOME/.cache/berth/kube}"
dir="$cache/$version-$hash"
bin="$dir/kube-apiserver"
if [[ "${1:-}" == "--where" ]]; then  # only say where the binary belongs; build nothing
  echo "$bin"
  exit 0
fi

mkdir -p "$dir"
# One build at a time per cache entry: a second caller waits, then finds the binary.
exec 9>"$dir/.lock"
flock 9
if [[ -x "$bin" ]]; then
  echo "build-kube: reusing cached kube-apiserver $version" >&2
else
  if ! command -v go >/dev/null; then
    echo "build-kube: Go not found (expected /usr/local/go/bin/go)" >&2
    exit 1
  fi
  major=${version#v}; major=${major%%.*}
  minor=${version#v*.}; minor=${minor%%.*}
  echo "build-kube: building kube-apiserver $version (cold build: many minutes)..." >&2
  start=$(date +%s)
  # Shared 2-core machines: build at low priority. The ldflags set what /version reports.
  (cd "$src" && nice -n 15 go build -trimpath -o "$bin.tmp" \
    -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=$version \
      -X k8s.io/component-base/version.gitMajor=$major \
      -X k8s.io/component-base/version.gitMinor=$minor \
      -X k8s.io/component-base/version.gitTreeState=clean" .)
  mv "$bin.tmp" "$bin"
  echo "build-kube: built in $(( $(date +%s) - start )) s, $(du -h "$bin" | cut -f1)" >&2
fi

if ! command -v etcd >/dev/null; then
  echo "build-kube: installing Debian's etcd-server..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq etcd-server >/dev/null
  # The package may start a system etcd on the default ports; the tests run their own on free
  # loopback ports with a temporary data directory, so the system one is only in the way.
  if command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  elif command -v service >/dev/null; then
    service etcd stop >/dev/null 2>&1 || true
  fi
fi

echo "KUBE_APISERVER=$bin"
echo "ETCD=$(command -v etcd)"
