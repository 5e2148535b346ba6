#!/usr/bin/env bash
# Create the project's virtual environment at .venv (idempotent) with the `berth` command in it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "berth needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -e '.[dev,platform]'
echo "environment ready: $(pwd)/.venv ($(.venv/bin/berth --help >/dev/null && echo 'berth installed'))"
