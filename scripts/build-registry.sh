#!/usr/bin/env bash
# Puts a real OCI registry on this machine for the image-build tests (tests/test_kube_build.py)
# and prints where it is (`--where`: only where the binary belongs, building nothing).
# Idempotent: a cached binary is reused, so only a cold machine pays for the Go build (under a
# minute, plus the module download on a machine without Go's cache).
#
# The registry is go-containerregistry's in-memory one (pkg/registry, what its cmd/registry
# serves), built from the Go module pinned in tools/registry/go.mod, because this machine reaches
# the Go module proxy but no download site. tools/registry/main.go adds optional Basic or bearer
# token authentication in front of it, so that the tests can check the registry client's logins.
# The binary is cached under ${BERTH_REGISTRY_CACHE:-~/.cache/berth/registry}/<version>-<hash>/,
# where the hash covers tools/registry/{go.mod,go.sum,main.go}: a changed pin builds anew, never
# a stale binary. tests/test_kube_build.py computes the same path (keep the two in step).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/lib/go-cache.sh
go_cache_locate build-registry "$root/tools/registry" github.com/google/go-containerregistry \
  "${BERTH_REGISTRY_CACHE:-$HOME/.cache/berth/registry}" registry
src="$root/tools/registry"
if [[ "${1:-}" == "--where" ]]; then  # only say where the binary belongs; build nothing
  echo "$bin"
  exit 0
fi

go_cache_build build-registry "$src" . "-s -w"

echo "REGISTRY=$bin"
