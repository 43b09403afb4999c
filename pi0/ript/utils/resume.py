"""Resumable checkpoints: model + optimizer + LR scheduler + every rank's RNG states + init-state history + iteration.

Layout of ``<run>/checkpoints/iter_NNNN/``: the policy (model.safetensors, config.json, norm_stats.json,
tokenizer.model), ``train_state.pt`` (optimizer, scheduler, iteration, curve; rank 0) and ``rank<r>.pt`` (that
rank's RNG states, sampler position and history). A checkpoint is written into ``iter_NNNN.tmp`` and renamed when
complete, then ``latest`` (a one-line file, replaced atomically) points at it: a run killed mid-save leaves the
previous checkpoint loadable.
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

LATEST = "latest"


def rng_state(trainer: RIPTTrainer) -> dict[str, Any]:
    """Every RNG this rank's training draws from (global ones + the trainer's, optimizer's and sampler's)."""
    sampler = trainer.rollouts.sampler
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "trainer_gen": trainer.generator.get_state(), "opt_gen": trainer.optimizer.generator.get_state(),
            "opt_rng": trainer.optimizer.rng.bit_generator.state, "sampler_rng": sampler.rng.bit_generator.state,
            "sampler_order": [int(i) for i in sampler._order], "anchor_rng": trainer.anchor_rng.bit_generator.state,
            "gate_rng": trainer.gate_rng.bit_generator.state}


def set_rng_state(trainer: RIPTTrainer, st: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if st["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    trainer.generator.set_state(st["trainer_gen"])
    trainer.optimizer.generator.set_state(st["opt_gen"])
    trainer.optimizer.rng.bit_generator.state = st["opt_rng"]
    trainer.rollouts.sampler.rng.bit_generator.state = st["sampler_rng"]
    trainer.rollouts.sampler._order = list(st["sampler_order"])
    if "anchor_rng" in st:  # absent from checkpoints written before the anchor and the refresh test were saved
        trainer.anchor_rng.bit_generator.state = st["anchor_rng"]
        trainer.gate_rng.bit_generator.state = st["gate_rng"]


def save_checkpoint(run_dir: str | Path, trainer: RIPTTrainer, scheduler: Any, info: DistInfo) -> Path:
    """Write ``checkpoints/iter_<it>`` atomically (all ranks call it; rank 0 writes the shared files)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"iter_{trainer.iteration:04d}"
    tmp = root / f"iter_{trainer.iteration:04d}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        trainer.policy.save_pretrained(tmp)
        torch.save({"optimizer": trainer.optimizer.optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "iteration": trainer.iteration, "curve": trainer.curve, "world_size": info.world_size,
                    # algo.behavior="frozen": the rollout snapshot (it lags the trained weights until its refresh)
                    "behavior": (trainer.frozen_behavior.model.state_dict()
                                 if trainer.frozen_behavior is not None else None)}, tmp / "train_state.pt")
    barrier(info)
    hist = trainer.rollouts.history
    # algo.replay_windows: this rank's buffer of past rollout windows (images included: up to the capacity x ~20 kB
    # for the tiny arena pi0)
    torch.save({"rng": rng_state(trainer), "history": hist.to_json() if hist is not None else None,
                "replay": trainer.replay.state_dict() if trainer.replay is not None else None},
               tmp / f"rank{info.rank}.pt")
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
    """Restore optimizer, scheduler, iteration, curve, this rank's RNGs and history (the model is loaded already)."""
    st = torch.load(ckpt / "train_state.pt", weights_only=False)
    if st["world_size"] != info.world_size:
        from pi0.errors import UserError
        raise UserError(f"--resume: {ckpt} was written by {st['world_size']} ranks; relaunch with that many "
                        f"(got {info.world_size})")
    trainer.optimizer.optimizer.load_state_dict(st["optimizer"])
    if scheduler is not None and st["scheduler"] is not None:
        scheduler.load_state_dict(st["scheduler"])
    trainer.iteration, trainer.curve = int(st["iteration"]), list(st["curve"])
    if st.get("behavior") is not None and trainer.frozen_behavior is not None:
        trainer.frozen_behavior.model.load_state_dict(st["behavior"])
    mine = torch.load(ckpt / f"rank{info.rank}.pt", weights_only=False)
    set_rng_state(trainer, mine["rng"])
    if mine.get("replay") is not None and trainer.replay is not None:
        trainer.replay.load_state_dict(mine["replay"])
    if mine["history"] is not None and trainer.rollouts.history is not None:
        h = trainer.rollouts.history
        entries = mine["history"]["states"]
        h.last = {(int(e["task_id"]), int(e["init_state_id"])): [float(r) for r in e["rewards"]] for e in entries}
        h.skips = {(int(e["task_id"]), int(e["init_state_id"])): int(e.get("skips", 0)) for e in entries}
