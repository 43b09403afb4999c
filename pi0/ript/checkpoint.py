"""Checkpoint / resume: the policy + ``RIPTTrainer.state_dict()`` (optimizer, RNGs, sampler, history, iteration) +
the LR scheduler.

Layout of ``<run>/checkpoints/iter_NNNN/``: the policy (model.safetensors, config.json, norm_stats.json,
tokenizer.model), ``train_state.pt`` (optimizer, scheduler; rank 0) and ``rank<r>.pt`` (that rank's trainer state:
iteration, curve, RNGs, sampler position, history). Under FSDP2 the weights are gathered and written in float32 by
rank 0, and the optimizer state goes sharded to ``optimizer/`` (torch.distributed.checkpoint). A checkpoint is
written into ``iter_NNNN.tmp`` and renamed when complete, then ``latest`` (a one-line file, replaced atomically)
points at it: a run killed mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pi0.ript.trainer import RIPTTrainer
from pi0.ript.utils.dist_utils import DistInfo, barrier
from pi0.ript.utils.fsdp import load_sharded_optimizer, save_policy, save_sharded_optimizer

LATEST = "latest"


def global_rng_state() -> dict[str, Any]:
    """The process-global RNGs (python, numpy, torch, cuda)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_global_rng_state(st: dict[str, Any]) -> None:
    """Inverse of :func:`global_rng_state`."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if st["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(run_dir: str | Path, trainer: RIPTTrainer, scheduler: Any, info: DistInfo) -> Path:
    """Write ``checkpoints/iter_<it>`` atomically (all ranks call it; rank 0 writes the shared files)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"iter_{trainer.iteration:04d}"
    tmp = root / f"iter_{trainer.iteration:04d}.tmp"
    st = trainer.state_dict()
    optimizer = st["update"].pop("optimizer")  # the same on every rank (unsharded): written once
    sharded = trainer.update.sharded
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    save_policy(trainer.policy, tmp, info)  # every rank: FSDP2 gathers the weights; rank 0 writes
    if sharded:
        save_sharded_optimizer(trainer.policy.model, trainer.update.optimizer, tmp / "optimizer")
        optimizer = None
    if info.is_main:
        torch.save({"optimizer": optimizer, "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "world_size": info.world_size, "sharded": sharded}, tmp / "train_state.pt")
    barrier(info)
    torch.save({"trainer": st, "rng": global_rng_state()}, tmp / f"rank{info.rank}.pt")
    barrier(info)
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        ptr = root / (LATEST + ".tmp")
        ptr.write_text(final.name + "\n")
        os.replace(ptr, root / LATEST)
    barrier(info)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint ``latest`` points at (None when there is none)."""
    ptr = Path(run_dir) / "checkpoints" / LATEST
    if not ptr.is_file():
        return None
    d = ptr.parent / ptr.read_text().strip()
    return d if (d / "train_state.pt").is_file() else None


def load_train_state(ckpt: Path, trainer: RIPTTrainer, scheduler: Any, info: DistInfo) -> None:
    """Restore the trainer's state (optimizer, iteration, curve, RNGs, sampler, history) and the scheduler (the
    model is loaded already)."""
    shared = torch.load(ckpt / "train_state.pt", weights_only=False)
    if shared["world_size"] != info.world_size:
        from pi0.errors import UserError
        raise UserError(f"--resume: {ckpt} was written by {shared['world_size']} ranks; relaunch with that many "
                        f"(got {info.world_size})")
    mine = torch.load(ckpt / f"rank{info.rank}.pt", weights_only=False)
    st = mine["trainer"]
    st["update"]["optimizer"] = shared["optimizer"]
    if shared.get("sharded", False) != trainer.update.sharded:
        from pi0.errors import UserError
        raise UserError(f"--resume: {ckpt} was written with algo.fsdp={shared.get('sharded', False)}; resume with "
                        f"the same setting")
    trainer.load_state_dict(st)
    if trainer.update.sharded:
        load_sharded_optimizer(trainer.policy.model, trainer.update.optimizer, ckpt / "optimizer")
    if scheduler is not None and shared["scheduler"] is not None:
        scheduler.load_state_dict(shared["scheduler"])
    set_global_rng_state(mine["rng"])
