#!/usr/bin/env bash
# 2-process gloo smoke run on CPU (< 4 minutes): one iteration each of stages 10 and 11 on the tiny config.
#   scripts/quick_distributed_test.sh [out_dir]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/quick_distributed_test}
PORT=${PORT:-29533}
start=$(date +%s)
TINY=(task.warm_start_steps=20 env.runner.max_steps=20 algo.iterations=1 "logging.out_dir=$OUT")
for stage in 10 11; do
  extra=(); [ "$stage" = 11 ] && extra=(features.enable_parallel_envs=true features.use_ript_vla_runner=true)
  echo "== stage $stage: torchrun --nproc_per_node=2 (gloo)"
  scripts/launch_distributed_training.sh --config debug_distributed_train --gpus 2 --master-port "$PORT" \
    --stage "$stage" "${TINY[@]}" "${extra[@]}" "logging.run_name=stage$stage"
  test -f "$OUT/stage$stage/final/model.safetensors"
  test -f "$OUT/stage$stage/checkpoints/iter_0001/rank1.pt"
done
echo "quick_distributed_test: PASS in $(( $(date +%s) - start ))s ($OUT)"
