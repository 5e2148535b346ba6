#!/usr/bin/env bash
# The simulator demo: replay the public Philly trace (82,247 jobs)
# on a 512-GPU cluster under three policies, and write a side-by-side report.
# Usage: scripts/simulate.sh [OUT_DIR]   (default: out/philly-512)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
OUT="${1:-out/philly-512}"
TRACE_DIR="${BERTH_PHILLY:-../shared/traces/philly}"
.venv/bin/berth trace import philly "$TRACE_DIR" --gpus 512 --out "$OUT/inputs"
.venv/bin/berth simulate \
  --cluster "$OUT/inputs/cluster.yaml" --teams "$OUT/inputs/teams.yaml" \
  --trace "$OUT/inputs/jobs.csv" --compare fifo,quota-spread,kueue-tas,berth --out "$OUT"
echo "report: $OUT/compare.md and $OUT/<policy>/report.md"
