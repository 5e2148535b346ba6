#!/usr/bin/env bash
# Airflow for this project, the embedded default: `airflow standalone` (SQLite, LocalExecutor,
# api-server, scheduler, DAG processor, triggerer) on this repo's dags/ and plugins/, and Berth's
# scheduling loop (`berth scheduler`, log $BERTH_HOME/scheduler.log), with Berth's store and
# files under $BERTH_HOME (default .berth/, git-ignored). Team pools are synced once it
# is up, and the admin user and password are printed.
# Usage: scripts/airflow.sh [run|start|stop]
#   run    in the foreground; Ctrl-C stops everything (the default)
#   start  in the background; returns once Airflow answers and the pools are synced
#   stop   stop what `start` started
# AIRFLOW_PORT=8080 and BERTH_ADMIN_PASSWORD=berth-admin by default.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }

export BERTH_HOME="${BERTH_HOME:-$ROOT/.berth}"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$BERTH_HOME/airflow}"
# `operators` and `scheduling` are imported by DAGs, tasks and triggers from the repo root.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$ROOT/.venv/bin:$PATH"  # standalone starts its components as `airflow ...`
PORT="${AIRFLOW_PORT:-8080}"
USER_NAME=admin
PASSWORD="${BERTH_ADMIN_PASSWORD:-berth-admin}"

export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__EXECUTOR=LocalExecutor
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$AIRFLOW_HOME/airflow.db"
export AIRFLOW__API__PORT="$PORT"
# Task processes report to the execution API on the same port.
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://localhost:$PORT/execution/"
export AIRFLOW__CORE__AUTH_MANAGER=airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="$USER_NAME:admin"
# A passwords file written here: the simple auth manager generates none for a user it lists.
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$AIRFLOW_HOME/simple_auth_manager_passwords.json"

PIDFILE="$AIRFLOW_HOME/airflow.pid"
case "${1:-run}" in
  run) ;;
  start)
    mkdir -p "$AIRFLOW_HOME"
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      echo "Airflow already running (pid $(cat "$PIDFILE")): http://localhost:$PORT"; exit 0
    fi
    setsid "$0" run >"$AIRFLOW_HOME/airflow.out" 2>&1 < /dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 300); do
      grep -q "^Airflow is up" "$AIRFLOW_HOME/airflow.out" 2>/dev/null && { cat "$AIRFLOW_HOME/airflow.out" | sed -n '/^Airflow is up/,$p'; exit 0; }
      kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { echo "Airflow failed to start:" >&2; tail -n 40 "$AIRFLOW_HOME/airflow.out" >&2; exit 1; }
      sleep 1
    done
    echo "Airflow not up in 300 s; see $AIRFLOW_HOME/airflow.out" >&2; exit 1 ;;
  stop)
    if [ -f "$PIDFILE" ]; then
      kill -TERM -- "-$(cat "$PIDFILE")" 2>/dev/null || true
      for _ in $(seq 1 30); do kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break; sleep 1; done
      kill -KILL -- "-$(cat "$PIDFILE")" 2>/dev/null || true
      rm -f "$PIDFILE"
    fi
    echo "Airflow stopped"; exit 0 ;;
  *) echo "usage: $0 [run|start|stop]" >&2; exit 2 ;;
esac

mkdir -p "$AIRFLOW_HOME" "$BERTH_HOME" "$ROOT/plugins"
printf '{"%s": "%s"}\n' "$USER_NAME" "$PASSWORD" > "$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
chmod 600 "$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"

"$ROOT/.venv/bin/airflow" standalone > "$AIRFLOW_HOME/standalone.log" 2>&1 &
STANDALONE=$!
# Berth's scheduling loop (berth/store/loop.py): decides every cycle, woken by each change.
"$ROOT/.venv/bin/berth" scheduler > "$BERTH_HOME/scheduler.log" 2>&1 &
LOOP=$!
trap 'kill "$STANDALONE" "$LOOP" 2>/dev/null; wait "$STANDALONE" "$LOOP" 2>/dev/null || true' EXIT INT TERM

echo "starting Airflow (log: $AIRFLOW_HOME/standalone.log) ..."
for _ in $(seq 1 180); do
  kill -0 "$STANDALONE" 2>/dev/null || { tail -n 40 "$AIRFLOW_HOME/standalone.log"; exit 1; }
  curl -sf "http://localhost:$PORT/api/v2/monitor/health" > /dev/null && break
  sleep 1
done
curl -sf "http://localhost:$PORT/api/v2/monitor/health" > /dev/null \
  || { echo "Airflow did not answer on port $PORT in 180 s" >&2; exit 1; }

"$ROOT/.venv/bin/berth" pools sync --api-url "http://localhost:$PORT" \
  --username "$USER_NAME" --password "$PASSWORD"

cat <<MSG

Airflow is up: http://localhost:$PORT
  user:     $USER_NAME
  password: $PASSWORD
DAGs: berth_job (launch a job from the trigger form), example_train_pipeline.
Berth store and files: $BERTH_HOME. Ctrl-C stops Airflow.
MSG
wait "$STANDALONE"
