"""pi0.models.cuda_graphs: static inputs by key, the copy-out, and the fallback contract of a failed capture (the
capture itself needs a GPU: tests/test_fast_sampler.py's cuda tests)."""

from __future__ import annotations

import torch

from pi0.models.cuda_graphs import GraphCache, clone_outputs


def test_copy_in_keeps_one_static_tensor_per_key_and_name():
    cache = GraphCache()
    a = cache.copy_in(("k",), {"x": torch.ones(2, 3), "s": torch.tensor(0.5)}, torch.device("cpu"))
    b = cache.copy_in(("k",), {"x": torch.full((2, 3), 2.0), "s": torch.tensor(0.25)}, torch.device("cpu"))
    assert a["x"] is b["x"] and a["s"] is b["s"]  # the same objects: a captured graph keeps reading them
    assert torch.equal(b["x"], torch.full((2, 3), 2.0)) and float(b["s"]) == 0.25
    other = cache.copy_in(("j",), {"x": torch.zeros(1)}, torch.device("cpu"))
    assert other["x"] is not a["x"] and len(cache.inputs) == 2


def test_clone_outputs_copies_tensors_and_tuples():
    t = torch.arange(3.0)
    c = clone_outputs(t)
    t.add_(1)  # the next replay overwrites the graph's output: the copy must not follow
    assert torch.equal(c, torch.arange(3.0))
    pair = clone_outputs((t, t * 2))
    assert isinstance(pair, tuple) and pair[0] is not t and torch.equal(pair[1], t * 2)


def test_a_failed_capture_returns_none_and_says_why():
    cache = GraphCache(warmup=1)
    ran: list[int] = []

    def fn():
        ran.append(1)
        raise RuntimeError("no capture here")

    assert cache.replay(("k",), fn) is None
    assert cache.error is not None and len(cache) == 0 and ("k",) not in cache
    if not torch.cuda.is_available():  # no CUDA stream to warm up on: it fails before running fn
        assert ran == []
