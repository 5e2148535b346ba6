#!/usr/bin/env bash
# The main job: set up, start MLflow and Airflow standalone (the embedded default), launch five
# training jobs through Airflow's REST API, follow them, and print what happened.
# Usage: scripts/demo.sh        run the demo (Airflow and MLflow keep running afterwards)
#        scripts/demo.sh stop   stop Airflow and MLflow
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "stop" ]; then
  scripts/setup.sh
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python scripts/demo.py "$@"
