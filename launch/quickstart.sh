#!/usr/bin/env bash
# The main job on CPU: a tiny random qwen3_5, 2 ranks (gloo) under the real `deepspeed` launcher, ZeRO-3,
# a few GRPO steps with per-step metrics, checkpoints in runs/quickstart/ckpt.
#   bash launch/quickstart.sh [key=value ...]        e.g. train.max_steps=5  or  train.resume=latest
set -euo pipefail
cd "$(dirname "$0")/.."
bash bin/setup
# shellcheck disable=SC1091
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # 2 ranks on a small CPU box: one thread each
mkdir -p runs/quickstart
[ -f runs/quickstart/groups.jsonl ] || python launch/make_toy_groups.py runs/quickstart/groups.jsonl
exec deepspeed --num_gpus "${NUM_RANKS:-2}" --master_port "${MASTER_PORT:-29531}" launch/train.py \
  --config configs/run/quickstart.yaml "$@"
