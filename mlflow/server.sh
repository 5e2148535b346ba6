#!/usr/bin/env bash
# The MLflow tracking server of the embedded default: SQLite backend store, artifacts proxied
# by the server into a local folder. Usage: mlflow/server.sh start|stop|status
#   BERTH_HOME (default <repo>/.berth), MLFLOW_PORT (default 5000).
# At scale, point it at PostgreSQL and S3 instead (see mlflow/README.md).
# This folder holds no Python package on purpose: `import mlflow` must find the library.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="${BERTH_HOME:-$ROOT/.berth}"
DIR="$HOME_DIR/mlflow"
PORT="${MLFLOW_PORT:-5000}"
PIDFILE="$DIR/server.pid"
mkdir -p "$DIR/artifacts"
running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
case "${1:-start}" in
  start)
    if running; then echo "MLflow already running: http://127.0.0.1:$PORT"; exit 0; fi
    setsid "$ROOT/.venv/bin/mlflow" server \
      --backend-store-uri "sqlite:///$DIR/mlflow.db" \
      --artifacts-destination "$DIR/artifacts" \
      --host 127.0.0.1 --port "$PORT" --workers 2 >"$DIR/server.log" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 120); do
      if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
        echo "MLflow: http://127.0.0.1:$PORT (log: $DIR/server.log)"; exit 0
      fi
      running || { echo "MLflow failed to start; see $DIR/server.log" >&2; tail -20 "$DIR/server.log" >&2; exit 1; }
      sleep 1
    done
    echo "MLflow did not answer on port $PORT within 120 s; see $DIR/server.log" >&2; exit 1 ;;
  stop)
    if running; then kill -- "-$(cat "$PIDFILE")" 2>/dev/null || kill "$(cat "$PIDFILE")"; fi
    rm -f "$PIDFILE"; echo "MLflow stopped" ;;
  status)
    if running; then echo "running: http://127.0.0.1:$PORT"; else echo "stopped"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
