"""The data-parallel warm start (``task.warm_start_procs``): 2 gloo ranks under torchrun, then the spawned path."""

import json
import time

import pytest
import torch

from conftest import REPO, torchrun
from pi0.errors import UserError
from pi0.ript.update import OptimizerConfig
from pi0.ript.warm_start import Plateau, TinyArenaConfig, cached_warm_start, warm_start_key


def test_ranks_sum_validation_counts_and_end_with_the_same_weights(tmp_path):
    torchrun(str(REPO / "tests" / "dist_start_worker.py"), str(tmp_path), timeout=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["val"] == r1["val"] == pytest.approx(3 / 5)  # the global rate, not (2/3 + 1/2) / 2
    assert [c["steps"] for c in r0["curve"]] == [2, 4, 6]
    assert [c["val_success"] for c in r0["curve"]] == [c["val_success"] for c in r1["curve"]]
    for k, v in r0["state"].items():  # same decisions, same averaged gradients: the same weights on both ranks
        assert torch.equal(v, r1["state"][k]), k
    assert any(not torch.equal(v, r0["init"][k]) for k, v in r0["state"].items())  # and they trained


def test_a_parallel_start_is_cached_under_its_own_key_and_a_bad_split_fails_first(tmp_path):
    cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
    stop = Plateau([(4, 7), (4, 8), (4, 9)], every=2, patience=1, require_convergence=True)
    opt = OptimizerConfig(lr=1e-3, minibatch_size=8)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="must divide among its 3 processes"):
        cached_warm_start(cfg, [(4, 0)], 10, opt, cache_dir=tmp_path, resolution=32, stop=stop, procs=3)
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "ript_warm_start").exists()  # before any work
    _, windows, root = cached_warm_start(cfg, [(4, 0), (4, 1)], 10, opt, cache_dir=tmp_path, resolution=32,
                                         stop=stop, procs=2)
    rec = json.loads((root / "warm_start.json").read_text())
    assert rec["procs"] == 2 and rec["stopped_at"] == 4 and [c["steps"] for c in rec["curve"]] == [2, 4]
    assert root.name == warm_start_key(cfg, [(4, 0), (4, 1)], 10, opt, stop, procs=2) \
        != warm_start_key(cfg, [(4, 0), (4, 1)], 10, opt, stop)  # one process trains another start
    assert (root / "model.safetensors").is_file() and windows
    _, _, again = cached_warm_start(cfg, [(4, 0), (4, 1)], 20, opt, cache_dir=tmp_path, resolution=32, stop=stop,
                                    procs=2)  # converged by its rule at 4: reused under a higher cap
    assert again == root and len(list(root.parent.iterdir())) == 1


def test_cache_keys_are_pinned():
    """Cached starts keep their keys: a field added to OptimizerConfig or TinyArenaConfig must leave these
    (computed on 2026-11-27) unchanged at its default, or every user's cached start retrains."""
    cfg, demos = TinyArenaConfig(), [(4, 0), (4, 1)]
    stop = Plateau([(4, 10)], 250, 4, smooth=4, require_convergence=True)
    assert warm_start_key(cfg, demos, None, OptimizerConfig(lr=2e-3, minibatch_size=64), stop) == "f65ffb9095eb"
    assert warm_start_key(cfg, demos, 10, OptimizerConfig()) == "a181408a49cf"


def test_a_metaworld_start_is_keyed_by_what_the_renderer_draws(monkeypatch):
    """A MetaWorld start trained on other images (e.g. before fast_render dropped multisampling) is another start;
    the arena's keys do not depend on MetaWorld's renderer."""
    import pi0.ript.warm_start as ws
    cfg, demos = TinyArenaConfig(), [(1, 0), (2, 0)]
    mw, arena = (warm_start_key(cfg, demos, 10, OptimizerConfig(), env=e) for e in ("metaworld", "arena"))
    monkeypatch.setattr(ws, "RENDER_TAG", ws.RENDER_TAG + " (another renderer)")
    assert warm_start_key(cfg, demos, 10, OptimizerConfig(), env="metaworld") != mw
    assert warm_start_key(cfg, demos, 10, OptimizerConfig(), env="arena") == arena
