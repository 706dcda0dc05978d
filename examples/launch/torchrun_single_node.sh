#!/usr/bin/env bash
# One node, every GPU (or N CPU processes): torchrun starts the processes, Lightning's Trainer joins them.
#   bash examples/launch/torchrun_single_node.sh                 # all GPUs, or 4 CPU processes
#   NPROC=2 bash examples/launch/torchrun_single_node.sh planner.fix="tp=2"
set -euo pipefail
cd "$(dirname "$0")/../.."

if command -v nvidia-smi >/dev/null 2>&1; then
  NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}; ACCEL=gpu
else
  NPROC=${NPROC:-4}; ACCEL=cpu
fi
# The plan prints the environment it wants (NCCL/HCCL hints, timeouts) after its table; autopar sets none of it.
# Preview them before launching:  python -m lightning_autopar.launch --cluster h100-sxm-dgx --plan "tp=8"

exec torchrun --standalone --nproc-per-node "$NPROC" examples/train_gpt.py \
  trainer.accelerator="$ACCEL" trainer.devices="$NPROC" "$@"
