#!/usr/bin/env bash
# Start the AdaFlash MLflow tracking server from environment settings (for docker or systemd); same
# defaults as `adaflash mlflow`. Runs `mlflow server` in the foreground (exec: signals reach it).
#
#   bash mlflow/start.sh                                  # 127.0.0.1:5000, SQLite + artifacts in runs/mlflow/
#   MLFLOW_BACKEND_STORE_URI=postgresql://u:p@db/mlflow MLFLOW_ARTIFACTS_DESTINATION=s3://bucket/adaflash \
#     MLFLOW_HOST=0.0.0.0 MLFLOW_ALLOWED_HOSTS=mlflow.internal bash mlflow/start.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DATA="${MLFLOW_DATA:-$PWD/runs/mlflow}"
HOST="${MLFLOW_HOST:-127.0.0.1}"
PORT="${MLFLOW_PORT:-5000}"
STORE="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$DATA/mlflow.db}"
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-$DATA/artifacts}"
MLFLOW_BIN="${MLFLOW_BIN:-$([ -x .venv/bin/mlflow ] && echo .venv/bin/mlflow || echo mlflow)}"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

mkdir -p "$DATA"
[[ "$ARTIFACTS" == *://* ]] || mkdir -p "$ARTIFACTS"
args=(server --host "$HOST" --port "$PORT" --workers "${MLFLOW_WORKERS:-2}"
      --backend-store-uri "$STORE" --serve-artifacts --artifacts-destination "$ARTIFACTS")
[ -n "${MLFLOW_ALLOWED_HOSTS:-}" ] && args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
echo "MLflow UI: http://$([ "$HOST" = 0.0.0.0 ] && echo 127.0.0.1 || echo "$HOST"):$PORT  (store $STORE, artifacts $ARTIFACTS)"
exec "$MLFLOW_BIN" "${args[@]}"
