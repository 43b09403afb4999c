r"""Bench: RL iterations per minute on the RL bench's settings, today's path against the fast one, in one process.

Both paths run ``pi0.ript.trainer.RIPTTrainer`` (LOOP, 4 kept groups x 8 rollouts per iteration) from the same
converged start (``bench/rl_improvement.py``'s cached start for ``--env/--task/--seed/--num_demos``), their
iterations interleaved (one of each in turn, so both see the same load), each for ``--iterations`` timed iterations
after ``--warmup`` untimed ones:

* ``baseline`` (today's path before this bench): eager ``PI0Model.sample_actions_sde``, sequential collection rounds
  (``algo.oversample=0``), the arena's 32 in-process envs / MetaWorld's ``--baseline_num_envs`` single-env workers,
  and with ``--trainable expert`` the update's joint pass over prefix and suffix (``cache_frozen_prefix=False``);
* ``fast``: Flow-SDE through ``FastSampler`` (``algo.fast_sampling``), every group of an oversampled round in flight
  (``algo.oversample``; the first informative groups kept, the rest abandoned), MetaWorld's envs packed
  ``envs_per_worker`` to a process over ``--workers`` processes, and the ``--trainable`` update (``expert``: only
  the expert is differentiated, on the prefix kv caches collection's sampler computed, ``algo.reuse_prefix``);
* ``fast_encode``: ``fast`` with ``algo.reuse_prefix=false``: its update encodes the frozen prefix again, without
  gradient, once per window and iteration (the fast path before collection's caches were reused).

Reported per path: seconds per iteration (collection / update), episodes per minute (episodes of the groups the
iteration used), decisions per second (observations through the policy per second of collection), update windows
per second, groups rolled per iteration. The last line is
``env=<arena|metaworld> iter_s=<s> baseline_iter_s=<s> ratio=<r> episodes_per_min=<n>``.

    .venv/bin/python bench/rl_throughput.py --env arena --iterations 30
    .venv/bin/python bench/rl_throughput.py --env metaworld --task 1 2 5 --num_demos 20 --train_states 200 \
        --val_start 200 --val_states 20 --eval_start 250 --eval_states 70 --iterations 5

A speed change must not change the numbers. ``--trace FILE`` writes a hash of every policy call's inputs and outputs
and of the weights after every iteration; a later run with ``--trace_against FILE`` (say, from a worktree of the old
code) prints the first record where the two runs part, or ``identical: N records``. With ``--lr 0`` the policy stays
at the start, so only collection is compared, and the two codes' iterations do the same work.

The GPU row (``bench/gpu_suite.py``'s ``rl_throughput`` step) times full-size pi0 instead of the bench's tiny start:
``--random_init full`` builds pi0 (PaliGemma 2B + the 300M expert, bf16) with random weights on ``--device``, the
arena renders at the model's 224 px, and the update trains ``--trainable expert`` in bf16 with float32 masters.
Random weights never succeed, so dynamic sampling is off there (every group is kept and trained on: the cost of an
iteration, not its learning) and no held-out evaluation runs:

    python bench/rl_throughput.py --random_init full --device cuda --trainable expert --iterations 3 --warmup 1

How far an iteration is from what the machine can do: ``--count_flops`` runs one more iteration per path (after the
trace and ``--final_eval``) with its arithmetic counted, collection and update apart (``torch.utils.flop_counter``:
matrix products and convolutions, plus CPU attention's fused op, forward and backward), records the shape of every
matrix product and runs each again alone on random operands. It prints GFLOP per iteration (per decision and per
window, times the timed iterations' means), the rate the products ran at alone, the floor (the iteration's FLOPs at
that rate) and the rate the policy calls and the update achieved:

    .venv/bin/python bench/rl_throughput.py --env arena --iterations 12 --warmup 1 --count_flops
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_improvement: the RL bench whose settings we time
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

import rl_improvement as rlb  # noqa: E402

from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.ript.init_states import InitStateSampler  # noqa: E402
from pi0.ript.trainer import RIPTTrainer, RLConfig  # noqa: E402
from pi0.rollout.types import PolicyOutput  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402


@dataclass
class Config(rlb.Config):
    """The RL bench's options (``bench/rl_improvement.py``) plus the throughput run's own."""

    iterations: int = 20  # timed iterations per path
    warmup: int = 2  # untimed iterations per path first (caches, allocator, compile)
    # which paths to run, in this order ("fast:<x>": the fast path at oversample x; "fast_encode[:<x>]": the fast path
    # with algo.reuse_prefix=false, its update encoding a frozen prefix again instead of reusing collection's)
    paths: str = "baseline,fast"
    baseline_num_envs: int = 0  # today's runner: 0 = arena num_groups x group_size in process, MetaWorld 2 workers
    json_out: str = ""  # write the results here as JSON too
    # a replay check for a speed change: a hash of every policy call's inputs and outputs and of the weights after
    # every iteration, one JSON line each, written here; ``trace_against`` compares this run's with an earlier file
    # and prints the first record where they part (two codes with identical traces ran the same numbers)
    trace: str = ""
    trace_against: str = ""
    # after the iterations, each path's policy on the held-out states (deterministic sampler, the same noise seed
    # for every path): the learning at equal iterations, not only the speed (0: skip)
    final_eval: int = 0
    device: str = "cpu"  # where the policy samples and trains (the envs stay on the host's cores)
    # "": the bench's cached converged start; "full": pi0's full size with random weights in bf16, the GPU
    # row; "tiny": Pi0Config.tiny the same way (a check that the row runs). Random weights: dynamic sampling off
    random_init: str = ""
    resolution: int = 0  # the envs' render size (0: 64 for the bench's start, the model's image size when random)
    max_steps: int = 0  # episode step cap (0: the env's own)
    # after the timed iterations, one more per path with its arithmetic counted (matrix products, convolutions and
    # attention, forward and backward) and the iteration's matrix products replayed alone at the same shapes: the
    # seconds an iteration's arithmetic would take at the speed this machine runs those products (the floor)
    count_flops: bool = False


def digest(*parts: Any) -> str:
    """A short SHA-1 of arrays (bytes, dtype and shape), dicts of them (by sorted key), lists and strings."""
    h = hashlib.sha1()

    def add(x: Any) -> None:
        if isinstance(x, dict):
            for k in sorted(x):
                h.update(str(k).encode())
                add(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)
        elif isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits
            h.update(b"bfloat16")
            add(x.detach().cpu().view(torch.int16).numpy())
        elif isinstance(x, torch.Tensor):
            add(x.detach().cpu().numpy())
        elif isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        else:
            h.update(repr(x).encode())

    add(list(parts))
    return h.hexdigest()[:16]


def first_divergence(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Where two traces (``--trace`` records) part, in words: ``identical: N records`` when they do not."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            what = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            return (f"first difference at record {i} ({a.get('path')} {a.get('kind')} {a.get('index')}): "
                    f"{', '.join(what)} differ")
    if len(ours) != len(theirs):
        return f"identical for {min(len(ours), len(theirs))} records, then one trace ends ({len(ours)} vs {len(theirs)})"
    return f"identical: {len(ours)} records"


class CountingPolicy:
    """Wraps a ChunkPolicy: counts its calls, the observations they carried and the seconds they took (and with
    ``trace`` a list, appends a hash of each call's inputs and outputs to it)."""

    def __init__(self, inner: Any, trace: list[dict[str, Any]] | None = None, name: str = ""):
        self.inner = inner
        self.calls = self.rows = 0
        self.seconds = 0.0
        self.trace, self.name = trace, name

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        t0 = time.perf_counter()
        out = self.inner.predict_chunks(obs, prompts)
        self.seconds += time.perf_counter() - t0
        if self.trace is not None:  # outside the timed span
            self.trace.append({"path": self.name, "kind": "call", "index": self.calls, "rows": len(obs),
                               "inputs": digest(obs, prompts), "outputs": digest(out.actions, out.extras)})
        self.calls += 1
        self.rows += len(obs)
        return out


# --------------------------------------------------------------------------- arithmetic (--count_flops)
MATMUL_OPS = ("mm", "addmm", "bmm")  # the matrix products recorded by shape and replayed alone


def attention_flops(q_shape: Sequence[int], k_shape: Sequence[int]) -> int:
    """Forward FLOPs of attention's two matrix products (Q K^T and P V): q (B, N, T, H), k (B, K, S, H) -> 4 B N T S H
    (grouped keys serve every query head, so the query heads count)."""
    b, n, t, h = q_shape
    return 4 * b * n * t * k_shape[2] * h


def matmul_flops(op: str, shapes: Sequence[Sequence[int]]) -> int:
    """FLOPs of a matrix product from its operands' shapes: mm (M, K) @ (K, N) and addmm's two factors -> 2 M K N;
    bmm (B, M, K) @ (B, K, N) -> 2 B M K N."""
    if op == "bmm":
        (b, m, k), (_, _, n) = shapes
        return 2 * b * m * k * n
    (m, k), (_, n) = shapes
    return 2 * m * k * n


class FlopMeter:
    """Counts an iteration's arithmetic (``torch.utils.flop_counter`` plus CPU attention, forward and backward) and
    records every matrix product's shapes, so that :meth:`replay_seconds` can time the same products alone."""

    def __init__(self) -> None:
        self.shapes: Counter = Counter()  # (op, operand shapes) -> calls

        def product(op: str) -> Callable[..., int]:
            def formula(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
                operands = tuple(tuple(a) for a in (args[1:3] if op == "addmm" else args[:2]))
                self.shapes[(op, operands)] += 1
                return matmul_flops(op, operands)
            return formula

        aten = torch.ops.aten
        self.mapping: dict[Any, Callable[..., int]] = {getattr(aten, op): product(op) for op in MATMUL_OPS}
        # CPU attention is one fused op that the counter does not know: its products, forward and backward (dQ, dK,
        # dV and dP: twice the forward's)
        self.mapping[aten._scaled_dot_product_flash_attention_for_cpu] = \
            lambda q, k, *a, out_shape=None, **kw: attention_flops(q, k)
        self.mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
            lambda g, q, k, *a, out_shape=None, **kw: 2 * attention_flops(q, k)

    def count(self) -> Any:
        """A FlopCounterMode over this meter's formulas (``with meter.count() as m: ...; m.get_total_flops()``)."""
        from torch.utils.flop_counter import FlopCounterMode

        return FlopCounterMode(display=False, custom_mapping=self.mapping)

    def replay_seconds(self, device: str = "cpu", dtype: torch.dtype = torch.float32, reps: int = 3
                       ) -> tuple[float, int]:
        """(seconds, FLOPs) of every recorded matrix product run again alone on random operands (the best of ``reps``
        timings per shape, times its call count)."""
        seconds, flops = 0.0, 0
        for (op, operands), calls in self.shapes.items():
            args = [torch.randn(s, device=device, dtype=dtype) for s in operands]
            fn = partial(torch.addmm, torch.randn(operands[1][1], device=device, dtype=dtype)) if op == "addmm" \
                else getattr(torch, op)
            best = float("inf")
            for _ in range(reps + 1):  # the first call warms the allocator and the kernel's choice
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*args)
                if device != "cpu":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            seconds += best * calls
            flops += matmul_flops(op, operands) * calls
        return seconds, flops


RANDOM_INIT = ("", "full", "tiny")


def rl_config(cfg: Config, fast: bool, oversample: float | None = None, policy: PI0Policy | None = None,
              reuse_prefix: bool = True) -> RLConfig:
    """The RL arm's settings (``rl_improvement.rl_config``), on today's path or the fast one (``oversample``:
    instead of ``cfg.oversample``; ``reuse_prefix``: ``algo.reuse_prefix``); a random-weight ``policy`` trains in its
    own dtype with every group kept."""
    over = (cfg.oversample if oversample is None else oversample) if fast else 0.0
    rl = dataclasses.replace(rlb.rl_config(cfg), oversample=over, fast_sampling=fast,
                             reuse_prefix=fast and reuse_prefix)
    if cfg.random_init:
        bf16 = policy is not None and policy.config.model.dtype == "bfloat16"
        rl = dataclasses.replace(rl, dynamic_sampling=False, precision="bf16" if bf16 else "float32")
    return rl


def random_policy(cfg: Config) -> PI0Policy:
    """pi0 of ``--random_init`` size with random weights, built on ``--device`` (the seed fixes them, so every
    path gets the same ones), bf16 at full size or on CUDA; the arena's 8-D state and 7-D absolute actions, LIBERO's
    camera slots."""
    from pi0.models.config import Pi0Config
    from pi0.models.pi0 import PI0Model
    from pi0.policies.pi0 import PolicyConfig, default_norm_stats
    from pi0.policies.presets import tiny_tokenizer

    # full size in bf16 everywhere (its float32 weights and the sampler's fused copies overflow a 24 GB host)
    dtype = "bfloat16" if cfg.random_init == "full" or torch.device(cfg.device).type == "cuda" else "float32"
    mc = Pi0Config(dtype=dtype) if cfg.random_init == "full" else Pi0Config.tiny(dtype=dtype)
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):  # a full-size init on the host takes a minute
        model = PI0Model(mc)
    return PI0Policy(PolicyConfig(model=mc), default_norm_stats(8, 7), tiny_tokenizer(mc.max_token_len),
                     model=model).eval()


def render_size(cfg: Config, policy: PI0Policy) -> int:
    """``--resolution``, else the model's image size for a random policy, else the bench's 64 px."""
    return cfg.resolution or (policy.config.model.vision.image_size if cfg.random_init else 64)


def baseline_runner(cfg: Config, policy: PI0Policy):
    """Today's runner of the RL arm: the arena's num_groups x group_size envs; MetaWorld's single-env workers."""
    n = cfg.baseline_num_envs or (cfg.num_groups * cfg.group_size if cfg.env == "arena" else 2)
    return rlb.env_runner(cfg.env, n, policy.config.n_action_steps, render_size(cfg, policy), cfg.max_steps or None,
                          num_init_states=rlb.num_init_states(cfg))


class BenchPath:
    """One path's trainer, runner and counters (built from the start at ``root``, or random: ``--random_init``)."""

    def __init__(self, cfg: Config, root: Path | None, name: str, trace: list[dict[str, Any]] | None = None):
        fast = name != "baseline"
        oversample = float(name.split(":", 1)[1]) if ":" in name else None  # "fast:1.0": that oversample
        self.cfg, self.name = cfg, name
        policy = random_policy(cfg) if root is None else PI0Policy.from_pretrained(root, device=cfg.device)
        policy.model.cache_frozen_prefix = fast  # the baseline's update: the joint pass, frozen prefix or not
        size, cap = render_size(cfg, policy), cfg.max_steps or None
        self.runner = rlb.make_runner(cfg, policy, resolution=size, max_steps=cap) if fast else \
            baseline_runner(cfg, policy)
        _, _, train_states = rlb.splits(cfg)
        self.trainer = RIPTTrainer(policy, self.runner, InitStateSampler(train_states, seed=cfg.seed + 1),
                                   rl_config(cfg, fast, oversample, policy, not name.startswith("fast_encode")))
        self.counting = CountingPolicy(self.trainer.rollouts.policy, trace, name)
        self.trace, self.iterations = trace, 0
        self.trainer.rollouts.policy = self.counting
        self.rows: list[dict[str, float]] = []

    def step(self, timed: bool) -> None:
        """One RL iteration (recorded when ``timed``)."""
        c, cfg = self.counting, self.cfg
        calls0, rows0, pol0 = c.calls, c.rows, c.seconds
        cuda = torch.device(cfg.device).type == "cuda"
        if cuda:  # the iteration's own memory: its peak over what the paths' models already hold
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        st = self.trainer.step()
        wall = time.perf_counter() - t0
        extra_gib = (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else 0.0
        if self.trace is not None:
            self.trace.append({"path": self.name, "kind": "weights", "index": self.iterations,
                               "weights": digest(dict(self.trainer.policy.model.state_dict()))})
        self.iterations += 1
        if not timed:
            return
        col = self.trainer.last_collection
        self.rows.append({"wall": wall, "rollout": st["time/rollout_s"], "update": st["time/update_s"],
                          "episodes": st["rollout/groups"] * cfg.group_size, "groups": st["rollout/groups"],
                          "kept": float(len(col.groups)), "windows": st["train/windows"],
                          "calls": float(c.calls - calls0), "decisions": float(c.rows - rows0),
                          "policy_s": c.seconds - pol0, "success": st["rollout/success_rate"],
                          "peak_extra_gib": extra_gib})
        print(f"[{self.name}] iteration {len(self.rows)}/{cfg.iterations}: {wall:.2f} s (collect "
              f"{st['time/rollout_s']:.2f}, update {st['time/update_s']:.2f}), {int(st['rollout/groups'])} groups "
              f"used, {len(col.groups)} kept, {int(self.rows[-1]['calls'])} policy calls", flush=True)

    def count_iteration(self) -> dict[str, float]:
        """``--count_flops``: one more iteration with collection's and the update's arithmetic counted apart and the
        matrix products replayed alone -> FLOPs and replay seconds per decision and per window."""
        tr, meters, flops = self.trainer, {"collect": FlopMeter(), "update": FlopMeter()}, {}

        def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                with meters[name].count() as mode:
                    out = fn(*args, **kwargs)
                flops[name] = mode.get_total_flops()
                return out
            return run

        rows0 = self.counting.rows
        tr.rollouts.collect = counted("collect", tr.rollouts.collect)  # instance attributes over the methods
        tr.update.step = counted("update", tr.update.step)
        try:
            st = tr.step()
        finally:
            del tr.rollouts.collect, tr.update.step
        n = {"collect": max(1, self.counting.rows - rows0), "update": max(1.0, st["train/windows"])}
        dtype = torch.bfloat16 if tr.policy.config.model.dtype == "bfloat16" else torch.float32
        out = {}
        for name, meter in meters.items():
            replay_s, replay_flops = meter.replay_seconds(self.cfg.device, dtype)
            per = "decision" if name == "collect" else "window"
            out[f"flops_per_{per}"] = flops.get(name, 0) / n[name]
            out[f"matmul_flops_per_{per}"] = replay_flops / n[name]
            out[f"matmul_replay_s_per_{per}"] = replay_s / n[name]
        return out

    def summary(self) -> dict[str, Any]:
        """Means over the timed iterations."""
        rows, n = self.rows, len(self.rows)
        s = {k: float(np.sum([r[k] for r in rows])) for k in rows[0]}
        return {"path": self.name, "iterations": n, "iter_s": s["wall"] / n, "collect_s": s["rollout"] / n,
                "update_s": s["update"] / n, "episodes_per_min": 60 * s["episodes"] / s["wall"],
                "decisions_per_s": s["decisions"] / s["rollout"], "policy_calls_per_iter": s["calls"] / n,
                "policy_s_per_iter": s["policy_s"] / n, "windows_per_s": s["windows"] / s["update"],
                "groups_per_iter": s["groups"] / n, "kept_per_iter": s["kept"] / n,
                "rollout_success": s["success"] / n,
                "peak_extra_gib": max(r["peak_extra_gib"] for r in rows),  # CUDA: peak over the models held
                "per_iteration": rows}


def arithmetic(summary: dict[str, Any], counted: dict[str, float]) -> dict[str, float]:
    """A path's timed means + its counted iteration -> GFLOP per iteration (collection, update), the rate the model
    ran at (FLOPs over the seconds of policy calls and update) and the floor: the iteration's FLOPs at the rate its
    own matrix products ran alone."""
    rows, n = summary["per_iteration"], summary["iterations"]
    decisions = sum(r["decisions"] for r in rows) / n
    windows = sum(r["windows"] for r in rows) / n
    collect = counted["flops_per_decision"] * decisions
    update = counted["flops_per_window"] * windows
    replay_s = counted["matmul_replay_s_per_decision"] * decisions + counted["matmul_replay_s_per_window"] * windows
    replay_flops = counted["matmul_flops_per_decision"] * decisions + counted["matmul_flops_per_window"] * windows
    rate = replay_flops / replay_s if replay_s > 0 else float("nan")
    model_s = summary["policy_s_per_iter"] + summary["update_s"]
    return {**counted, "gflop_collect": collect / 1e9, "gflop_update": update / 1e9,
            "gflop_iter": (collect + update) / 1e9, "matmul_gflops_alone": rate / 1e9,
            "floor_s": (collect + update) / rate if rate == rate else float("nan"),
            "model_s": model_s, "model_gflops": (collect + update) / model_s / 1e9 if model_s else float("nan")}


def arithmetic_line(name: str, a: dict[str, float]) -> str:
    """One line of ``--count_flops`` results."""
    return (f"[{name}] arithmetic per iteration: {a['gflop_iter']:.2f} GFLOP (collection {a['gflop_collect']:.2f}: "
            f"{a['flops_per_decision'] / 1e6:.1f} MFLOP a decision; update {a['gflop_update']:.2f}: "
            f"{a['flops_per_window'] / 1e6:.1f} MFLOP a window). Its matrix products alone run at "
            f"{a['matmul_gflops_alone']:.1f} GFLOP/s, so the arithmetic takes at least {a['floor_s']:.2f} s; the "
            f"policy calls and the update took {a['model_s']:.2f} s ({a['model_gflops']:.1f} GFLOP/s)")


def write_trace(cfg: Config, trace: list[dict[str, Any]]) -> None:
    """``--trace``: the records as JSON lines; ``--trace_against``: where this run parts from the earlier one."""
    if cfg.trace:
        Path(cfg.trace).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.trace).write_text("".join(json.dumps(r) + "\n" for r in trace))
    if cfg.trace_against:
        theirs = [json.loads(line) for line in Path(cfg.trace_against).read_text().splitlines() if line]
        print(f"replay against {cfg.trace_against}: {first_divergence(trace, theirs)}", flush=True)


def run_paths(cfg: Config, root: Path | None, names: list[str]) -> dict[str, dict[str, Any]]:
    """The paths' iterations interleaved (one of each in turn), so that both see the same machine load."""
    trace: list[dict[str, Any]] | None = [] if cfg.trace or cfg.trace_against else None
    paths = [BenchPath(cfg, root, n, trace) for n in names]
    try:
        for i in range(cfg.warmup + cfg.iterations):
            for p in paths:
                p.step(timed=i >= cfg.warmup)
        out = {p.name: p.summary() for p in paths}
        if trace is not None:
            write_trace(cfg, trace)
        if cfg.final_eval:
            _, held, _ = rlb.splits(cfg)
            held = [(t, i) for t, i in held if i < cfg.eval_start + cfg.final_eval]
            for p in paths:
                rate = rlb.evaluate(p.runner, p.trainer.policy, held, seed=cfg.seed + 100)
                out[p.name]["held_out"] = {"success": rate, "se": rlb.se(rate, len(held)), "states": len(held)}
                print(f"[{p.name}] held-out success after {cfg.iterations + cfg.warmup} iterations: {rate:.3f} "
                      f"+- {rlb.se(rate, len(held)):.3f} ({len(held)} states)", flush=True)
        if cfg.count_flops:  # after the trace and the evaluation: an extra iteration that neither sees
            for p in paths:
                out[p.name]["arithmetic"] = arithmetic(out[p.name], p.count_iteration())
                print(arithmetic_line(p.name, out[p.name]["arithmetic"]), flush=True)
    finally:
        for p in paths:
            p.runner.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the paths and print the table and the summary line."""
    cfg = parse_config(Config, list(sys.argv[1:] if argv is None else argv), __doc__)
    paths = [p for p in cfg.paths.split(",") if p]
    bad = [p for p in paths if p != "baseline" and p.split(":")[0] not in ("fast", "fast_encode")]
    if not paths or bad or len(set(paths)) != len(paths):
        raise SystemExit(f"error: --paths takes baseline, fast, fast:<oversample>, fast_encode and "
                         f"fast_encode:<oversample> once each (comma-separated), got {cfg.paths!r}")
    for p in paths:
        if ":" in p:
            try:
                float(p.split(":", 1)[1])
            except ValueError:
                raise SystemExit(f"error: --paths: {p!r} needs a number after 'fast:'") from None
    if cfg.iterations < 1 or cfg.warmup < 0:
        raise SystemExit("error: --iterations must be >= 1 and --warmup >= 0")
    if cfg.random_init not in RANDOM_INIT:
        raise SystemExit(f"error: --random_init must be one of {RANDOM_INIT[1:]} (or empty), got {cfg.random_init!r}")
    if cfg.random_init and (cfg.env != "arena" or cfg.final_eval):
        raise SystemExit("error: --random_init times the arena only, without --final_eval (random weights learn "
                         "nothing to evaluate)")
    if cfg.trace_against and not Path(cfg.trace_against).is_file():
        raise SystemExit(f"error: --trace_against: no trace file at {cfg.trace_against}")
    if cfg.resolution < 0 or cfg.max_steps < 0:
        raise SystemExit("error: --resolution and --max_steps must be >= 0 (0: the default)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    load0 = os.getloadavg()
    if cfg.random_init:
        root, start = None, {"random_init": cfg.random_init}
        print(f"start: random weights ({cfg.random_init}), every group kept", flush=True)
    else:
        _, _, root, rec = rlb.start(cfg)
        start = {k: rec[k] for k in ("demos", "steps", "plateau")}
        print(f"start: {cfg.num_demos} demos, {rec['steps']} SFT steps, validation plateau {rec['plateau']:.3f} "
              f"({root})", flush=True)
    results = run_paths(cfg, root, paths)
    cols = ("iter_s", "collect_s", "update_s", "episodes_per_min", "decisions_per_s", "windows_per_s",
            "policy_calls_per_iter", "groups_per_iter", "rollout_success")
    cols += ("peak_extra_gib",) if torch.device(cfg.device).type == "cuda" else ()
    print("| path | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for p, r in results.items():
        print(f"| {p} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    load1 = os.getloadavg()
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min)")
    out = {"config": asdict(cfg), "start": start, "results": results,
           "load_before": load0, "load_after": load1}
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(out, indent=1))
    new = results.get("fast") or results[next((p for p in reversed(paths) if p != "baseline"), paths[0])]
    base = results.get("baseline")
    base_s = base["iter_s"] if base else float("nan")
    print(f"env={cfg.env} iter_s={new['iter_s']:.3f} baseline_iter_s={base_s:.3f} ratio={base_s / new['iter_s']:.2f} "
          f"episodes_per_min={new['episodes_per_min']:.1f}")
    return out


if __name__ == "__main__":
    main()
