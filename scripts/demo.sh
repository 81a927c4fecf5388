#!/usr/bin/env bash
# Set up (idempotent), then run a local mesh: a coordinator and two peers on this machine answer one prompt with
# the bundled SmolLM2. Usage: bash scripts/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${MESH_DEMO_PORT:-9000}
export MESH_TOKEN=${MESH_TOKEN:-$(.venv/bin/python -c "import secrets; print(secrets.token_urlsafe(24))")}
PROMPT=${1:-"What is the capital of France? Answer in one sentence."}
MODEL=$(.venv/bin/python -c "from engine.sources import default_model_path; print(default_model_path())")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
for i in 1 2; do
  .venv/bin/mesh-peer --join "127.0.0.1:$PORT" --listen 127.0.0.1:0 --model "$MODEL" --name "peer-$i" \
    2> >(sed "s/^/[peer $i] /" >&2) &
  pids+=($!)
done
# --placement memory: the demo shows the layers split over both peers; placed by measured speed, two peers on one
# machine are one stage (a hop between two processes of one box costs more than it saves) and the second is left out
.venv/bin/mesh-coord --listen "127.0.0.1:$PORT" --min-peers 2 --settle 0.5 --placement memory --prompt "$PROMPT" \
  --max-tokens 64
