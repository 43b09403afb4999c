r"""Saved policies scored two ways on one set of init states: deterministic (how every arm of the RL bench is scored)
and Flow-SDE (how the RL arm collects, and so the policy its objective improves).

Where RL raises the Flow-SDE success but not the deterministic one, what it learned does not carry over to the
policy the bench reports (issue 39's measured reason on MetaWorld, bench/README.md).

    MUJOCO_GL=egl .venv/bin/python bench/sde_gap.py --env metaworld --task 1 2 --states 250 320 --seed 0 \
        --policy start=/tmp/pi0_cache/ript_warm_start/fccea5315e94 rl=runs/bench_rl_mw2/seed0/rl/snap03 \
        --sde 1.0:0 --json_out runs/sde_gap.json

``--policy NAME=DIR`` (checkpoints: ``model.safetensors`` + ``config.json`` + ``norm_stats.json``), ``--sde
NOISE_LEVEL:STEP[:KIND]`` per stochastic sampler (``STEP`` -1: drawn per call, -2: every step; ``KIND`` flow_sde,
the default, or cps: ``pi0.models.flow_sde``). Deterministic episodes draw their noise keyed to (``--seed`` + 100,
task, state, repeat, decision) as the bench's evaluation does, so they are paired across policies; stochastic
episodes draw from one generator per sampler and policy, seeded alike, so their rates are compared with each rate's
own standard error. The env runner is the RL bench's (2 x 4 x 8 envs; MetaWorld: 2 worker processes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

from pi0.evaluation.paired import paired_difference, per_task, rate_se  # noqa: E402
from pi0.models.flow_sde import check_sde, sampler_step  # noqa: E402
from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.ript.collection import sde_collector  # noqa: E402
from pi0.ript.warm_start import ENVS, env_runner, evaluate_episodes  # noqa: E402


def parse_sde(item: str) -> tuple[float, int, str]:
    """``"NOISE_LEVEL:STEP[:KIND]"`` -> (noise level, step >= -2, kind: flow_sde or cps); one-line error otherwise
    (the step is checked against each policy's denoising steps by :func:`check_samplers`)."""
    level, sep, rest = item.partition(":")
    step, _, kind = rest.partition(":")
    try:
        out = (float(level), int(step), kind or "flow_sde")
        if not sep or out[1] < -2:
            raise ValueError("STEP must be a denoising step, -1 (drawn) or -2 (every step)")
        check_sde(out[2], out[0], None, 1)
    except ValueError as e:
        raise SystemExit(f"error: --sde takes NOISE_LEVEL:STEP[:KIND] (a level > 0, a denoising step, -1 or -2, kind "
                         f"flow_sde or cps), got {item!r}: {e}") from None
    return out


def check_samplers(samplers: dict[str, tuple[float, int, str] | None], num_steps: int) -> None:
    """One-line error for a sampler whose step a policy of ``num_steps`` denoising steps cannot make stochastic."""
    for label, sde in samplers.items():
        if sde is not None:
            level, step, kind = sde
            try:
                check_sde(kind, level, sampler_step(step), num_steps)
            except ValueError as e:
                raise SystemExit(f"error: --sde {label}: {e}") from None


def parse_policies(items: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` items -> {name: checkpoint dir}; one-line error for a bad item or a missing checkpoint."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or name in out:
            raise SystemExit(f"error: --policy takes distinct NAME=DIR items, got {item!r}")
        if not (Path(path) / "model.safetensors").is_file():
            raise SystemExit(f"error: --policy {item}: no model.safetensors in {path}")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Score every policy under every sampler -> the JSON record (also printed as a table)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="metaworld", choices=ENVS)
    p.add_argument("--task", type=int, nargs="+", required=True)
    p.add_argument("--states", type=int, nargs=2, required=True, metavar=("LO", "HI"), help="init states LO..HI-1")
    p.add_argument("--policy", nargs="+", required=True, metavar="NAME=DIR")
    p.add_argument("--sde", nargs="*", default=["1.0:0"], metavar="NOISE_LEVEL:STEP[:KIND]",
                   help="stochastic samplers to score beside the deterministic one (none: --sde alone)")
    p.add_argument("--repeats", type=int, default=1, help="episodes per state and sampler")
    p.add_argument("--seed", type=int, default=0, help="the bench seed (deterministic noise: seed + 100)")
    p.add_argument("--num_envs", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json_out", type=Path, default=None)
    a = p.parse_args(argv)
    # label -> (noise level, step, kind) of each stochastic sampler; None: deterministic
    samplers: dict[str, tuple[float, int, str] | None] = {"det": None}
    for lv, st, k in map(parse_sde, a.sde):
        samplers[f"{'sde' if k == 'flow_sde' else k} {lv}:{st}"] = (lv, st, k)
    paths = parse_policies(a.policy)
    lo, hi = a.states
    if not 0 <= lo < hi:
        raise SystemExit(f"error: --states needs 0 <= LO < HI, got {lo} {hi}")
    torch.set_num_threads(1)
    states = [(t, i) for t in a.task for i in range(lo, hi)]
    pols = {name: PI0Policy.from_pretrained(path) for name, path in paths.items()}
    first = next(iter(pols.values()))
    check_samplers(samplers, first.config.num_steps)
    outcomes: dict[str, dict[str, list[int]]] = {s: {} for s in samplers}
    with env_runner(a.env, a.num_envs, first.config.n_action_steps, num_init_states=hi,
                    envs_per_worker=-(-a.num_envs // a.workers)) as runner:
        for s, sde in samplers.items():
            for name, pol in pols.items():
                t0 = time.perf_counter()
                if sde is None:
                    o = evaluate_episodes(runner, pol, states, a.repeats, seed=a.seed + 100)
                else:
                    level, step, kind = sde
                    eps = runner.run(states, group_size=a.repeats, policy=sde_collector(
                        pol, level, step, torch.Generator().manual_seed(a.seed + 7), kind))
                    o = np.array([float(e.success) for e in eps])
                outcomes[s][name] = o.astype(int).tolist()
                print(f"{s:>12} {name:>8}: {o.mean():.3f} +- {rate_se(o.mean(), len(o)):.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    n = (hi - lo) * a.repeats
    rows = {s: {name: {"success": float(np.mean(o)), "se": rate_se(float(np.mean(o)), len(o)),
                       "per_task": {str(t): r[name] for t, r in per_task(a.task, n, {name: o}).items()}}
                for name, o in per.items()} for s, per in outcomes.items()}
    names = list(pols)
    paired = {f"{b}-{names[0]}": dict(zip(("mean", "se"), paired_difference(outcomes["det"][b],
                                                                            outcomes["det"][names[0]])))
              for b in names[1:]}
    print(f"\n| sampler | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for s in samplers:
        print(f"| {s} | " + " | ".join(f"{rows[s][m]['success']:.3f} +- {rows[s][m]['se']:.3f}" for m in names) + " |")
    for k, d in paired.items():
        print(f"det {k} (paired): {d['mean']:+.3f} +- {d['se']:.3f}")
    rec = {"command": " ".join(sys.argv), "env": a.env, "task": a.task, "states": [lo, hi], "repeats": a.repeats,
           "seed": a.seed, "policies": {k: str(v) for k, v in paths.items()}, "rates": rows, "det_paired": paired,
           "outcomes": outcomes}
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
