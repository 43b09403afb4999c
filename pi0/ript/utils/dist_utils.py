"""torchrun helpers: process-group setup, task sharding, stats all-reduce and deadlock-free data-parallel updates.

Data parallelism is done by hand (gradients all-reduced after each accumulation group) rather than with
``DistributedDataParallel``, because a rank may have no data at all in an iteration (dynamic sampling dropped all
of its groups): such a rank still joins every all-reduce with zero gradients ("masked batch"), so every rank runs
the same number of collectives and optimizer steps. The update itself is ``pi0.ript.update.PolicyUpdate``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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
        import torch._dynamo as _dynamo  # noqa: F401  (`import torch._dynamo` would make `torch` a local name)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, device)


def cleanup_distributed() -> None:
    """Destroy the process group if one is running.

    FSDP2 modules and their device mesh hold the group through reference cycles; a ``gc.collect()`` first frees the
    ones the caller has dropped, so that no gloo worker thread outlives the group (see setup_distributed)."""
    if dist.is_initialized():
        import gc
        gc.collect()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    """Barrier when distributed, no-op otherwise."""
    if info.enabled:
        dist.barrier()


def _gloo_rank(rank: int, procs: int, store: str, out: str, fn: Callable[..., Any], args: tuple) -> None:
    """The body of one :func:`spawn_gloo` rank: one torch thread, a gloo group over a file store, ``fn``; rank 0
    saves what it returned to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
    try:
        result = fn(DistInfo(rank, procs), *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., Any], procs: int, *args: Any) -> Any:
    """``fn(info, *args)`` on ``procs`` spawned CPU ranks (gloo, one torch thread each, data parallel on one
    machine without torchrun) -> what rank 0 returned. ``fn`` and ``args`` must pickle (a module-level function)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo_") as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_gloo_rank, args=(procs, os.path.join(tmp, "store"), out, fn, args), nprocs=procs,
                           join=True, start_method="spawn")
        return torch.load(out, weights_only=False)


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
