"""torchrun helpers: process-group setup, task sharding, stats all-reduce and deadlock-free data-parallel updates.

Data parallelism is done by hand (gradients all-reduced after each accumulation group) rather than with
``DistributedDataParallel``, because a rank may have no data at all in an iteration (dynamic sampling dropped all
of its groups): such a rank still joins every all-reduce with zero gradients ("masked batch"), so every rank runs
the same number of collectives and optimizer steps.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import Window
from pi0.ript.algos.rl_optimizers.rl_optimizer_pi0_cfg import RLOptimizerPI0_CFG


@dataclass
class DistInfo:
    """Rank / world size / local rank / device of this process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """True on rank 0 (logging, progress bars, checkpoints)."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.world_size > 1


def setup_distributed(backend: str = "auto", device: str = "cpu", timeout_s: float = 600.0) -> DistInfo:
    """Init the process group from torchrun's env (nccl on GPU, gloo on CPU); a plain process gets world 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":  # the scalar all-reduces (DistributedStatsSynchronizer) use CPU tensors: gloo
            backend = "cpu:gloo,cuda:nccl"
        # torch 2.13: a first import of torch._dynamo *after* the group exists (model init pulls it in through
        # torch._refs) takes ten references to the group that destroy_process_group never drops. The gloo worker
        # threads then outlive cleanup_distributed into interpreter shutdown, where one that frees a finished
        # collective's tensor needs the GIL and aborts the process ("terminate called without an active
        # exception": it failed CI once, and about one torchrun run in ten under load). Importing it first keeps
        # destroy_process_group complete.
        import torch._dynamo  # noqa: F401
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, device)


def cleanup_distributed() -> None:
    """Destroy the process group if one is running."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    """Barrier when distributed, no-op otherwise."""
    if info.enabled:
        dist.barrier()


def shard_tasks_across_gpus(states_per_task: Mapping[int, Sequence[int]], rank: int, world_size: int
                            ) -> dict[int, list[int]]:
    """This rank's share of the ``(task, init_state)`` pairs: pair i of the flattened list goes to rank i % world."""
    pairs = [(int(t), int(s)) for t, ids in sorted(states_per_task.items()) for s in ids]
    if len(pairs) < world_size:
        raise ValueError(f"{len(pairs)} init states cannot be sharded over {world_size} ranks; add train states")
    out: dict[int, list[int]] = {}
    for t, s in pairs[rank::world_size]:
        out.setdefault(t, []).append(s)
    return out


class DistributedStatsSynchronizer:
    """All-reduces per-rank scalars: sums (successes, counts), means weighted by count, and max (timings)."""

    def __init__(self, info: DistInfo):
        self.info = info

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.info.enabled:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, stats: Mapping[str, float]) -> dict[str, float]:
        """Sum of each value over ranks."""
        keys = sorted(stats)
        return dict(zip(keys, self._reduce([float(stats[k]) for k in keys], dist.ReduceOp.SUM)))

    def max(self, stats: Mapping[str, float]) -> dict[str, float]:
        """Max of each value over ranks (wall-clock timings: the slowest rank)."""
        keys = sorted(stats)
        return dict(zip(keys, self._reduce([float(stats[k]) for k in keys], dist.ReduceOp.MAX)))

    def weighted_mean(self, value: float, count: float) -> tuple[float, float]:
        """(sum(value*count)/sum(count), sum(count)) over ranks; 0 when no rank has a count."""
        s, n = self._reduce([float(value) * float(count), float(count)], dist.ReduceOp.SUM)
        return (s / n if n else 0.0), n


class DistributedRLOptimizer(RLOptimizerPI0_CFG):
    """``RLOptimizerPI0_CFG`` whose every rank runs the same number of optimizer steps and collectives.

    Step count = max over ranks of ``epochs x ceil(ceil(windows / minibatch) / grad_accum)``; a rank that runs out
    of minibatches (or has none) contributes zero gradients (a masked batch). Gradients are summed over ranks and
    divided by the global number of minibatches in the step, so the update equals single-process training on the
    union of the ranks' minibatches. The non-finite guard acts on the reduced gradient (same decision everywhere).
    """

    def __init__(self, *args: Any, info: DistInfo | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.info = info or DistInfo()

    def _allreduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.info.enabled:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def step(self, windows: Sequence[Window], use_condition: bool = True, max_steps: int | None = None
             ) -> dict[str, float]:
        """Epochs x minibatches with cross-rank gradient averaging; every rank returns after the same steps."""
        c = self.config
        t0 = time.perf_counter()
        model = self.adapter.policy.model
        was_training = model.training
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        mbs: list[np.ndarray] = []
        for _ in range(c.epochs):
            order = self.rng.permutation(len(windows)) if windows else np.zeros(0, int)
            mbs += [order[i: i + c.minibatch_size] for i in range(0, len(order), c.minibatch_size)]
        local_steps = math.ceil(len(mbs) / c.grad_accum_steps)
        n_steps = int(self._allreduce(torch.tensor([local_steps], dtype=torch.int64), dist.ReduceOp.MAX
                                      if self.info.enabled else None).item())
        if max_steps is not None:
            n_steps = min(n_steps, max_steps)
        sums: dict[str, list[float]] = {}
        steps = skipped = 0
        for s in range(n_steps):
            self.optimizer.zero_grad(set_to_none=False)
            mine = mbs[s * c.grad_accum_steps: (s + 1) * c.grad_accum_steps]
            used = 0
            for mb in mine:
                loss, st = self.adapter.loss(self.adapter.collate([windows[i] for i in mb]), self.generator,
                                             use_condition=use_condition)
                if not math.isfinite(float(loss.detach())):
                    continue  # this minibatch is masked out; the rank still joins the all-reduce below
                for k, v in st.items():
                    sums.setdefault(k, []).append(v)
                loss.backward()
                used += 1
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + [torch.tensor([float(used)], dtype=params[0].dtype, device=params[0].device)])
            self._allreduce(flat)
            total = float(flat[-1])
            if total == 0:  # every rank's minibatches were empty / non-finite: nothing to apply
                skipped += int(bool(mine))
                continue
            off = 0
            for p in params:
                n = p.numel()
                p.grad = (flat[off: off + n] / total).view_as(p).clone()
                off += n
            ok = self._apply(params)
            steps += int(ok)
            skipped += int(not ok)
        self.optimizer.zero_grad(set_to_none=True)
        model.train(was_training)
        self.num_skipped += skipped
        out = {k: float(np.mean(v)) for k, v in sums.items()}
        out.update(steps=float(steps), skipped_steps=float(skipped), update_time=time.perf_counter() - t0)
        return out
