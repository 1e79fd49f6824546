#!/usr/bin/env bash
# Local services on loopback: a Prefect server (UI + API, SQLite) and an MLflow tracking server (SQLite, job
# execution disabled to keep memory low). `infra/services.sh start|stop|status`. State lives in infra/.state/.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${LOCKSTEP_SERVICES_STATE:-infra/.state}
BIN=${LOCKSTEP_BIN:-.venv/bin}
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)

wait_http() {  # url, seconds
  for _ in $(seq 1 "$2"); do
    if "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "service at $1 did not answer within $2 s; see $STATE/*.log" >&2
  return 1
}

running() {  # name
  [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null
}

port_free() {  # port: nothing listens on it
  ! "$BIN/python" -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2).close()" \
    "$1" 2>/dev/null
}

launch() {  # name, command...: start a service unless it is running
  local name=$1
  shift
  if running "$name"; then
    echo "$name already running (pid $(cat "$STATE/$name.pid"))"; return 0
  fi
  setsid nohup "$@" > "$STATE/$name.log" 2>&1 &
  echo $! > "$STATE/$name.pid"
}

ready() {  # name, url: wait for the service to answer; if it does not, show its log and stop what was started
  if ! wait_http "$2" 120; then
    echo "--- last lines of $STATE/$1.log:" >&2
    tail -n 20 "$STATE/$1.log" >&2
    stop >&2
    return 1
  fi
}

start() {
  local name port var
  for spec in "prefect $PREFECT_PORT PREFECT_PORT" "mlflow $MLFLOW_PORT MLFLOW_PORT"; do  # before starting either
    read -r name port var <<< "$spec"
    if ! running "$name" && ! port_free "$port"; then
      echo "port $port ($name) is in use by another program: stop it, or choose another port" \
        "($var=$((port + 1)) $0 start)" >&2
      return 1
    fi
  done
  PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STATE/prefect.db" \
    launch prefect \
    "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" --analytics-off
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false launch mlflow \
    "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" \
    --backend-store-uri "sqlite:///$STATE/mlflow.db" --default-artifact-root "$STATE/mlartifacts" --workers 1
  ready prefect "http://127.0.0.1:$PREFECT_PORT/api/health"
  ready mlflow "http://127.0.0.1:$MLFLOW_PORT/health"
  echo "Prefect UI and API: http://127.0.0.1:$PREFECT_PORT   (export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api)"
  echo "MLflow UI:          http://127.0.0.1:$MLFLOW_PORT   (-o tracking.uri=http://127.0.0.1:$MLFLOW_PORT)"
}

stop() {
  for name in prefect mlflow; do
    if [ -f "$STATE/$name.pid" ]; then
      pid=$(cat "$STATE/$name.pid")
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      rm -f "$STATE/$name.pid"
      echo "stopped $name"
    fi
  done
}

status() {
  for name in prefect mlflow; do
    if running "$name"; then
      echo "$name: running (pid $(cat "$STATE/$name.pid"))"
    else
      echo "$name: stopped"
    fi
  done
}

case "${1:-status}" in
  start|stop|status) "${1:-status}" ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
