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

start() {
  if [ -f "$STATE/prefect.pid" ] && kill -0 "$(cat "$STATE/prefect.pid")" 2>/dev/null; then
    echo "services already running (infra/services.sh stop first)"; return 0
  fi
  PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
    PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STATE/prefect.db" \
    setsid nohup "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT" --analytics-off \
    > "$STATE/prefect.log" 2>&1 &
  echo $! > "$STATE/prefect.pid"
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid nohup "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" \
    --backend-store-uri "sqlite:///$STATE/mlflow.db" --default-artifact-root "$STATE/mlartifacts" --workers 1 \
    > "$STATE/mlflow.log" 2>&1 &
  echo $! > "$STATE/mlflow.pid"
  wait_http "http://127.0.0.1:$PREFECT_PORT/api/health" 120
  wait_http "http://127.0.0.1:$MLFLOW_PORT/health" 120
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
    if [ -f "$STATE/$name.pid" ] && kill -0 "$(cat "$STATE/$name.pid")" 2>/dev/null; then
      echo "$name: running (pid $(cat "$STATE/$name.pid"))"
    else
      echo "$name: stopped"
    fi
  done
}

"${1:-status}"
