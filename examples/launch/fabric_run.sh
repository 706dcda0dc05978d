#!/usr/bin/env bash
# The Fabric CLI (torchrun underneath). `fabric run --strategy` only takes its fixed list, so the script itself
# says Fabric(strategy="autopar"); leave --strategy out.
#   bash examples/launch/fabric_run.sh                        # 4 CPU processes, or every GPU
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/launch/fabric_run.sh   # on each node
set -euo pipefail
cd "$(dirname "$0")/../.."

if command -v nvidia-smi >/dev/null 2>&1; then
  ACCEL=cuda; DEVICES=${DEVICES:-$(nvidia-smi -L | wc -l)}
else
  ACCEL=cpu; DEVICES=${DEVICES:-4}
fi
exec fabric run examples/fabric_gpt.py --accelerator "$ACCEL" --devices "$DEVICES" \
  --num-nodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --main-address "${MASTER_ADDR:-127.0.0.1}" --main-port "${MASTER_PORT:-29400}" "$@"
