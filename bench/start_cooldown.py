r"""Is a start converged for continued SFT? Validation states only: how make run's ``task.warm_start_cooldown``
was chosen.

The start a stage-11 preset trains (``tiny_warm_start``, cached as make run caches it, without its cooldown), then
for each ``--cooldown N``: N SFT steps with the lr decayed linearly to 0 (``pi0.ript.warm_start.cool_down`` with
the start's own lr, minibatch and seed, so the row of the preset's N is the start make run uses), scored on the
preset's validation states; then continued SFT as the preset's baseline arm runs it (``baseline.sft_lr``, a fresh
AdamW warmed up over ``baseline.warmup_steps``, 32 windows a step, its seed and ``threads``) for ``--sft_steps``,
scored again. The cooldown runs on the start's threads (``task.warm_start_threads``, else every core), as the job's.
Every score uses the same per-episode noise (``--repeats`` rollouts per state), so the differences are paired.

    .venv/bin/python bench/start_cooldown.py --cooldown 0 500 1500 --repeats 3            # the preset's start
    .venv/bin/python bench/start_cooldown.py --cooldown 0 500 -- task.warm_start_seed=1   # another start

A start converged for continued SFT gains nothing from it (``sft_gain`` within its SE of 0). The last line is
``cooldown=<N> val=<rate> sft_gain=<diff> se=<se>`` for the largest N.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

from pi0.errors import UserError  # noqa: E402
from pi0.evaluation.paired import paired_difference, rate_se  # noqa: E402
from pi0.ript.config.schema import load_config  # noqa: E402
from pi0.ript.sft_baseline import baseline_update  # noqa: E402
from pi0.ript.utils.train_loop import start_optimizer, start_threads, start_val_states, tiny_warm_start  # noqa: E402
from pi0.ript.warm_start import TinyArenaConfig, cool_down, evaluate_episodes, validation_runner  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    """Score each cooldown length and the continued SFT after it on validation states; print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="stage11_ript_vla")
    ap.add_argument("--cooldown", type=int, nargs="+", default=[0, 500])
    ap.add_argument("--sft_steps", type=int, default=1000, help="continued SFT steps after each cooldown")
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per validation state")
    ap.add_argument("--json_out", default="")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    args = ap.parse_args(argv)
    if min(args.cooldown) < 0 or args.sft_steps < 0 or args.repeats < 1:
        raise SystemExit("error: --cooldown and --sft_steps take counts >= 0, --repeats >= 1")
    try:
        preset = load_config(args.preset, list(args.overrides))
        cfg = load_config(args.preset, list(args.overrides) + ["task.warm_start_cooldown=0"])
    except UserError as e:
        raise SystemExit(f"error: {e}")
    t = cfg.task
    if t.env != "arena" or t.warm_start_patience <= 0:
        raise SystemExit("error: the bench needs an arena preset with a converged start (task.warm_start_patience > 0)")
    policy, windows = tiny_warm_start(cfg)
    start = copy.deepcopy(policy.model.state_dict())
    val = start_val_states(t)
    runner = validation_runner(t.env, val, len(val), TinyArenaConfig.n_action_steps, cfg.env.resolution)

    def score() -> np.ndarray:
        return evaluate_episodes(runner, policy, val, repeats=args.repeats, seed=t.warm_start_seed)

    rows, preset_state = [], None
    with runner:
        for n in args.cooldown:
            policy.model.load_state_dict(start)
            t0 = time.perf_counter()
            torch.set_num_threads(start_threads(t))  # as tiny_warm_start trains (another count rounds otherwise)
            cool_down(policy, windows, start_optimizer(t), n, seed=t.warm_start_seed)
            torch.set_num_threads(cfg.threads)  # as the baseline arm trains and the job scores
            cool_s = time.perf_counter() - t0
            if n == preset.task.warm_start_cooldown:
                preset_state = copy.deepcopy(policy.model.state_dict())
            cooled = score()
            upd = baseline_update(cfg, policy)
            t0 = time.perf_counter()
            for _ in range(args.sft_steps):  # one minibatch a step, as the arm draws them
                upd.step(windows, max_steps=1)
            policy.eval()
            sft_s = time.perf_counter() - t0
            after = score()
            gain, se = paired_difference(after, cooled)
            rows.append({"cooldown": n, "val": float(cooled.mean()), "val_se": rate_se(cooled.mean(), len(cooled)),
                         "after_sft": float(after.mean()), "sft_gain": gain, "sft_gain_se": se,
                         "cooldown_s": cool_s, "sft_s": sft_s, "episodes": len(cooled)})
            print(f"cooldown {n:5d} steps ({cool_s:5.1f} s): validation {cooled.mean():.3f} +- "
                  f"{rows[-1]['val_se']:.3f}; after {args.sft_steps} continued SFT steps ({sft_s:.0f} s) "
                  f"{after.mean():.3f}, gain {gain:+.3f} +- {se:.3f} (paired, {len(cooled)} episodes)", flush=True)
    if preset_state is not None:  # that row's weights are the start the preset trains (loaded, or trained and cached)
        ref, _ = tiny_warm_start(preset)
        same = all(torch.equal(v, preset_state[k]) for k, v in ref.model.state_dict().items())
        if not same:
            raise SystemExit(f"error: the cooldown of {preset.task.warm_start_cooldown} steps here differs from the "
                             f"start {args.preset} trains")
        print(f"cooldown {preset.task.warm_start_cooldown}: the same weights as the start {args.preset} uses")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"preset": args.preset, "overrides": args.overrides,
                                                   "sft_steps": args.sft_steps, "rows": rows}, indent=1))
    last = rows[-1]
    print(f"cooldown={last['cooldown']} val={last['val']:.3f} sft_gain={last['sft_gain']:+.3f} "
          f"se={last['sft_gain_se']:.3f}")
    return rows


if __name__ == "__main__":
    main()
