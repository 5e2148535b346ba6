#!/usr/bin/env bash
# Puts KWOK (Kubernetes WithOut Kubelet, sigs.k8s.io/kwok) on this machine for the scale
# benchmark and its test (bench/kube_bench.py --kubelet kwok, tests/test_kube_kwok.py), and
# prints where it is (`--where`: only where the binary belongs, building nothing). Idempotent: a
# cached binary is reused, so only a cold machine pays for the Go build (a few minutes, plus the
# module download on a machine without Go's cache).
#
# KWOK plays the kubelets of thousands of simulated nodes in one process: it moves the pods bound
# to them through their phases as its Stages say (tests/kwok.py writes Berth's). It is built from
# the Go module pinned in tools/kwok/go.mod (its own command, sigs.k8s.io/kwok/cmd/kwok), because
# this machine reaches the Go module proxy but no download site. The binary is cached under
# ${BERTH_KWOK_CACHE:-~/.cache/berth/kwok}/<version>-<hash>/, where the hash covers
# tools/kwok/{go.mod,go.sum,main.go}: a changed pin builds anew, never a stale binary.
# tests/kwok.py computes the same path (keep the two in step).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/lib/go-cache.sh
go_cache_locate build-kwok "$root/tools/kwok" sigs.k8s.io/kwok \
  "${BERTH_KWOK_CACHE:-$HOME/.cache/berth/kwok}" kwok
src="$root/tools/kwok"
if [[ "${1:-}" == "--where" ]]; then  # only say where the binary belongs; build nothing
  echo "$bin"
  exit 0
fi

go_cache_build build-kwok "$src" sigs.k8s.io/kwok/cmd/kwok "-s -w"

echo "KWOK=$bin"
