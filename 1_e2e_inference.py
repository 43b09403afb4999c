"""Stage 1: end-to-end pi0 / pi0.5 / pi0-FAST inference (images + prompt + state -> an action chunk).

Adds: the pi0 model itself. With no arguments it runs the embedded default, a tiny random pi0 with an
offline-built tokenizer (no download); with --checkpoint it runs converted real weights.

    python 1_e2e_inference.py                                   # tiny embedded default (what `make run` runs)
    python 1_e2e_inference.py --checkpoint ckpts/pi0_libero --dtype bfloat16 --device cuda
    python 1_e2e_inference.py --checkpoint <openpi-PyTorch / RLinf / LeRobot dir> --tokenizer paligemma_tokenizer.model
    python 1_e2e_inference.py --model pi0fast                   # tiny pi0-FAST (autoregressive FAST tokens)
    python 1_e2e_inference.py --model pi05                      # tiny pi0.5 (adaRMS time conditioning)
    torchrun --nproc_per_node 2 1_e2e_inference.py              # each rank runs its own batch (smoke test)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from pi0.errors import UserError, require_path, run_cli
from pi0.policies import load_policy, model_type_of
from pi0.policies.presets import synthetic_observation, tiny_fast_policy, tiny_policy
from pi0.utils.cli import parse_config


TINY_MODELS = ("pi0", "pi05", "pi0fast")


@dataclass
class Config:
    """Stage 1 options."""

    checkpoint: str | None = None  # any policy directory (pi0, pi0.5, pi0-FAST; ours, openpi-PyTorch, RLinf, LeRobot)
    # None = tiny embedded default
    tokenizer: str | None = None  # openpi-PyTorch / RLinf / LeRobot directories: PaliGemma's sentencepiece model
    norm_stats: str | None = None  # ... their norm_stats.json when the directory has none
    openpi_config: str | None = None  # ... the openpi TrainConfig preset (pi0.5 needs one; e.g. pi05_libero)
    model: str = "pi0"  # tiny default to build without --checkpoint: "pi0", "pi05" or "pi0fast"
    device: str = "cpu"
    dtype: str | None = None  # "float32" | "bfloat16"; None = as saved
    batch_size: int = 1
    num_steps: int = 10
    prompt: str = "pick up the black bowl and place it on the plate"
    seed: int = 0


def main(argv: list[str] | None = None) -> np.ndarray:
    """Load (or build) a policy, run one action chunk, print it and the time taken."""
    cfg = parse_config(Config, argv, __doc__)
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(cfg.seed + rank)
    t0 = time.perf_counter()
    overrides = {"num_steps": cfg.num_steps} | ({"dtype": cfg.dtype} if cfg.dtype else {})
    if cfg.model not in TINY_MODELS:
        raise UserError(f"--model must be one of {list(TINY_MODELS)}, got {cfg.model!r}")
    if cfg.checkpoint:
        require_path(cfg.checkpoint, "checkpoint", "give a policy directory: ours (convert_pi0_to_hf_lerobot.py), "
                     "openpi-PyTorch, RLinf or LeRobot", True)
        if model_type_of(cfg.checkpoint) == "pi0fast":  # no Euler steps
            overrides.pop("num_steps")
        policy = load_policy(cfg.checkpoint, device=cfg.device, tokenizer=cfg.tokenizer, norm_stats=cfg.norm_stats,
                             openpi_config=cfg.openpi_config, **overrides)
    elif cfg.model == "pi0fast":
        policy = tiny_fast_policy(seed=cfg.seed).to(cfg.device)
    else:
        policy = tiny_policy(seed=cfg.seed, num_steps=cfg.num_steps, dtype=cfg.dtype or "float32",
                             pi05=cfg.model == "pi05").to(cfg.device)
    load_s = time.perf_counter() - t0
    obs = synthetic_observation(policy, cfg.batch_size, seed=cfg.seed + rank, prompt=cfg.prompt)
    policy.predict_action_chunk(obs)  # warm-up
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    actions = policy.predict_action_chunk(obs)
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
    infer_s = time.perf_counter() - t1
    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    print(f"[rank {rank}] policy: {cfg.checkpoint or 'tiny embedded default'} ({policy.config.model.dtype}); "
          f"load {load_s:.2f}s")
    print(f"[rank {rank}] action chunk {tuple(actions.shape)} (first 5 steps):\n{actions[0, :5].numpy()}")
    steps = (f"up to {policy.config.model.max_decoding_steps} decoded tokens" if hasattr(policy, "fast_tokenizer")
             else f"{cfg.num_steps} Euler steps")
    print(f"[rank {rank}] inference: {infer_s * 1000:.1f} ms for batch {cfg.batch_size}, {steps}")
    return actions.numpy()


if __name__ == "__main__":
    run_cli(main)
