#!/usr/bin/env bash
# Launch the config-driven RIPT job with torchrun on one or several nodes (stage 10 by default).
#   scripts/launch_distributed_training.sh --config distributed_train_pi0 --gpus 8 [--nodes 2 --node-rank 0 \
#       --master-addr host0 --master-port 29500] [--stage 11] [key=value ...]
# Run the same command on every node with its own --node-rank. --gpus is processes per node (CPU: gloo).
set -euo pipefail
CONFIG=distributed_train_pi0; GPUS=1; NODES=1; NODE_RANK=0; ADDR=127.0.0.1; PORT=29500; STAGE=10; EXTRA=()
usage() { sed -n '2,5p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --nodes) NODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --master-addr) ADDR="$2"; shift 2 ;;
    --master-port) PORT="$2"; shift 2 ;;
    --stage) STAGE="$2"; shift 2 ;;
    -h|--help) usage ;;
    *=*) EXTRA+=("$1"); shift ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$GPUS" "$NODES" "$NODE_RANK" "$PORT"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "error: --gpus/--nodes/--node-rank/--master-port need integers, got '$v'" >&2; exit 2; }
done
[ "$NODE_RANK" -lt "$NODES" ] || { echo "error: --node-rank $NODE_RANK must be < --nodes $NODES" >&2; exit 2; }
case "$STAGE" in 10) SCRIPT=10_train_with_distributed.py ;; 11) SCRIPT=11_train_ript_vla_style.py ;;
  *) echo "error: --stage must be 10 or 11" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --nnodes="$NODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS" \
  --master_addr="$ADDR" --master_port="$PORT" "$SCRIPT" --config_path "$CONFIG" "${EXTRA[@]}"
