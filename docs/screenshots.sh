#!/usr/bin/env bash
# The README's pictures, taken in headless Chromium (docs/screenshots.py) from a real run: MLflow and Prefect servers on loopback, the
# demo's pipeline against them, then the MLflow run page and the flow run's report artifact.
#   bash docs/screenshots.sh [MODEL_DIR] [OVERRIDES...]   (default: the demo's model; needs Chromium: apt's `chromium`)
# Writes docs/img/mlflow_run.png (the run's overview), docs/img/mlflow_charts.png (its metrics by step),
# docs/img/prefect_report.png and docs/img/demo_terminal.txt (the run's terminal).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/SmolLM2-135M-Instruct}; shift || true
work=$(mktemp -d) bin=.venv/bin img=docs/img
mkdir -p "$img"
port() { "$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mlflow_port=$(port) prefect_port=$(port)
export PREFECT_HOME=$work/prefect PREFECT_API_URL=http://127.0.0.1:$prefect_port/api PREFECT_SERVER_ANALYTICS_ENABLED=false
"$bin/mlflow" server --host 127.0.0.1 --port "$mlflow_port" --backend-store-uri "sqlite:///$work/mlflow.db" \
  --default-artifact-root "$work/mlruns" > "$work/mlflow.log" 2>&1 &
"$bin/prefect" server start --host 127.0.0.1 --port "$prefect_port" > "$work/prefect.log" 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
for url in "http://127.0.0.1:$mlflow_port/health" "$PREFECT_API_URL/health"; do
  for _ in $(seq 120); do curl -sf "$url" > /dev/null && break; sleep 1; done
done
"$bin/grpo" pipeline --config configs/demo_cpu.yaml actor_rollout_ref.model.path="$model" \
  tracking.mlflow_tracking_uri="http://127.0.0.1:$mlflow_port" trainer.default_local_dir="$work/run" \
  data.train_files="[$work/data/train.parquet]" data.val_files="[$work/data/test.parquet]" "$@" 2>&1 \
  | tee "$img/demo_terminal.txt"
read -r run_page artifact_url < <("$bin/python" - "$mlflow_port" "$prefect_port" <<'PY'
import sys
from mlflow import MlflowClient
from prefect.client.orchestration import get_client

mlflow_port, prefect_port = sys.argv[1:]
client = MlflowClient(f"http://127.0.0.1:{mlflow_port}")
run = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time DESC"])[0]
with get_client(sync_client=True) as prefect:
    artifact = next(a for a in prefect.read_artifacts() if a.key == "grpo-pipeline-report")
print(f"http://127.0.0.1:{mlflow_port}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}",  # + /TAB?QUERY
      f"http://127.0.0.1:{prefect_port}/artifacts/artifact/{artifact.id}")
PY
)
"$bin/pip" install --quiet playwright  # a picture-taking tool, not a dependency of the project
"$bin/python" docs/screenshots.py "$run_page?workflowType=machine_learning" "$artifact_url" "$img"
ls -la "$img"
