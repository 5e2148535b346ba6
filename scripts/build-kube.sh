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
source scripts/lib/go-cache.sh
go_cache_locate build-kube "$root/tools/kube" k8s.io/kubernetes \
  "${BERTH_KUBE_CACHE:-$HOME/.cache/berth/kube}" kube-apiserver
src="$root/tools/kube"
if [[ "${1:-}" == "--where" ]]; then  # only say where the binary belongs; build nothing
  echo "$bin"
  exit 0
fi

# The ldflags set what /version reports.
major=${version#v}; major=${major%%.*}
minor=${version#v*.}; minor=${minor%%.*}
go_cache_build build-kube "$src" . "-s -w \
  -X k8s.io/component-base/version.gitVersion=$version \
  -X k8s.io/component-base/version.gitMajor=$major \
  -X k8s.io/component-base/version.gitMinor=$minor \
  -X k8s.io/component-base/version.gitTreeState=clean"

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
