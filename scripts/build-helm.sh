#!/usr/bin/env bash
# Puts Helm on this machine for Berth's chart (docker/chart) and its tests (tests/helm.py), and
# prints where it is (`--where`: only where the binary belongs, building nothing). Idempotent: a
# cached binary is reused, so only a cold machine pays for the Go build (a few minutes, plus the
# module download on a machine without Go's cache).
#
# Helm is built from the Go module pinned in tools/helm/go.mod (its own command,
# helm.sh/helm/v3/cmd/helm), because this machine reaches the Go module proxy but no download
# site. The binary is cached under ${BERTH_HELM_CACHE:-~/.cache/berth/helm}/<version>-<hash>/,
# where the hash covers tools/helm/{go.mod,go.sum,main.go}: a changed pin builds anew, never a
# stale binary. tests/helm.py computes the same path (keep the two in step).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
source scripts/lib/go-cache.sh
go_cache_locate build-helm "$root/tools/helm" helm.sh/helm/v3 \
  "${BERTH_HELM_CACHE:-$HOME/.cache/berth/helm}" helm
src="$root/tools/helm"
if [[ "${1:-}" == "--where" ]]; then  # only say where the binary belongs; build nothing
  echo "$bin"
  exit 0
fi

# The ldflag sets what `helm version` reports.
go_cache_build build-helm "$src" helm.sh/helm/v3/cmd/helm \
  "-s -w -X helm.sh/helm/v3/internal/version.version=$version"

echo "HELM=$bin"
