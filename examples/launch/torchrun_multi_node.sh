#!/usr/bin/env bash
# Several nodes without a scheduler: run this on every node with the same MASTER_ADDR and its own NODE_RANK.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/launch/torchrun_multi_node.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/launch/torchrun_multi_node.sh
# Extra arguments are Hydra overrides, e.g. cluster=h100-sxm-dgx planner.fix="tp=8".
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}

# Environment the plan asks for (printed by the strategy with the plan; preview with
# `python -m lightning_autopar.launch --cluster <preset> --nodes $NNODES`). Uncomment what applies:
# export AUTOPAR_PG_TIMEOUT=1800            # process-group timeout (s): rendezvous of several nodes
# export NCCL_SOCKET_IFNAME=^lo,docker       # NVIDIA: bootstrap over the interface that reaches the other nodes
# export CUDA_DEVICE_MAX_CONNECTIONS=1       # NVIDIA with tp > 1
# export HCCL_SOCKET_IFNAME=^lo,docker HCCL_CONNECT_TIMEOUT=1200 HCCL_ALGO="level0:NA;level1:H-D_R"   # Ascend

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RUN_ID:-autopar}" \
  examples/train_gpt.py trainer.accelerator=gpu trainer.devices="$NPROC" trainer.num_nodes="$NNODES" "$@"
