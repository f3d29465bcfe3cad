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
# No device visible: tell DeepSpeed "cpu" instead of letting the launcher and each rank probe and warn (local ranks
# only: this script launches no other node).
if [ -z "${DS_ACCELERATOR:-}" ] && python ds_longstraw/accelerator.py; then export DS_ACCELERATOR=cpu; fi
mkdir -p runs/quickstart
[ -f runs/quickstart/groups.jsonl ] || python launch/make_toy_groups.py runs/quickstart/groups.jsonl
# The launcher's INFO lines (and its note that a local run has no hostfile) stay out of view; LAUNCHER_LOG_LEVEL=info
# shows them.
exec deepspeed --num_gpus "${NUM_RANKS:-2}" --master_port "${MASTER_PORT:-29531}" \
  --log_level "${LAUNCHER_LOG_LEVEL:-error}" launch/train.py \
  --config configs/run/quickstart.yaml "$@"
