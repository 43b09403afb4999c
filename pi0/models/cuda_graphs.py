"""CUDA graphs captured once per static shape and replayed with copy-in / copy-out (the fast sampler's).

A graph replays the kernels it captured on the tensors it captured them on, so everything a graph reads or writes
lives in static tensors: the inputs are copied into ``GraphCache.copy_in``'s static copies before a replay, and the
outputs are copied out after it (``copy_out``), since the next replay overwrites them. Graphs are keyed by what fixes
their shapes and their control flow (batch size, live cameras, prompt bucket, number of steps, the stochastic step);
``pi0.models.fast_sampler.FastSampler`` builds the keys and the closures, this module captures and replays them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch


def clone_outputs(out: Any) -> Any:
    """A graph's output tensor (or tuple of them) -> fresh copies that the next replay cannot overwrite."""
    return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()


class GraphCache:
    """CUDA graphs by key: :meth:`replay` captures ``fn`` on first use (after ``warmup`` un-captured runs on a side
    stream, where torch.compile compiles and autotunes) and replays it afterwards; :meth:`copy_in` holds the static
    inputs a graph reads. A capture that fails leaves ``error`` set and :meth:`replay` returning None: the caller
    runs ``fn`` itself (a robot keeps acting on the un-captured path)."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}  # key -> (graph, its output tensors)
        self.inputs: dict[tuple, dict[str, torch.Tensor]] = {}  # key -> static input copies
        self.error: str | None = None  # why the last failed capture failed

    def __len__(self) -> int:
        return len(self.graphs)

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.graphs)

    def clear(self) -> None:
        """Drop every graph (the weights they read were re-allocated); static inputs stay (their shapes hold)."""
        self.graphs.clear()

    def copy_in(self, key: tuple, inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """``inputs`` copied into ``key``'s static tensors on ``device`` (allocated on first use; a graph cannot copy
        from pageable host memory) -> those static tensors, by name."""
        statics = self.inputs.get(key)
        if statics is None:
            statics = self.inputs[key] = {k: torch.empty(v.shape, dtype=v.dtype, device=device)
                                          for k, v in inputs.items()}
        for k, v in inputs.items():
            statics[k].copy_(v)
        return statics

    def replay(self, key: tuple, fn: Callable[[], Any], copy_out: Callable[[Any], Any] = clone_outputs) -> Any:
        """Run ``fn`` (a closure over static tensors returning tensors) as ``key``'s CUDA graph, captured on first use
        -> ``copy_out`` of its outputs (default: clones); None if the capture failed (``error`` says why)."""
        if key not in self.graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(self.warmup):  # compiles / autotunes outside the capture
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fn()
                self.graphs[key] = (graph, out)
            except Exception as e:  # noqa: BLE001 - the caller falls back to the un-captured path
                self.error = f"{type(e).__name__}: {e}"
                if torch.cuda.is_available():
                    try:
                        torch.cuda.synchronize()  # drain what the failed capture left queued
                    except RuntimeError:
                        pass
                return None
        graph, out = self.graphs[key]
        graph.replay()
        return copy_out(out)
