r"""Stage 10: the config-driven RIPT job on several processes with torchrun (nccl on GPU, gloo on CPU).

Adds to stage 9: init states sharded across ranks with seeds offset by rank; collection stopped early on every
rank through a global counter (file on shared storage, or the c10d store across nodes); gradients averaged over
ranks with the same number of collectives and optimizer steps everywhere (a rank whose groups were all filtered
joins with masked, zero-gradient batches: no deadlock); stats all-reduced; tqdm, TensorBoard and checkpoints on
rank 0 (every rank's RNG state is saved too). ``algo.fsdp=true`` shards every parameter, gradient and optimizer
state over the ranks with FSDP2 instead (full fine-tuning on N GPUs; sharded checkpoints).

    torchrun --nproc_per_node=2 10_train_with_distributed.py --config_path debug_distributed_train
    torchrun --nproc_per_node=8 10_train_with_distributed.py --config_path distributed_train_pi0 \
        task.checkpoint=ckpts/pi0_libero
    torchrun --nproc_per_node=8 10_train_with_distributed.py --config_path fsdp_full_finetune \
        task.checkpoint=ckpts/pi0_libero                 # trainable=all, FSDP2, bf16, checkpointing
    scripts/launch_distributed_training.sh --config distributed_train_pi0 --gpus 8 --nodes 2 --node-rank 0 \
        --master-addr host0 --master-port 29500      # multi-node
"""

from __future__ import annotations

from pi0.errors import run_cli
from pi0.ript.utils.train_loop import cli_main


def main(argv: list[str] | None = None) -> list[dict]:
    """Load + validate the config, train on this rank."""
    return cli_main(argv, "distributed_train_pi0", __doc__)


if __name__ == "__main__":
    run_cli(main)
