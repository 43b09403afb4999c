r"""Bench: where does LOOP move the executed actions: through the stochastic step its PPO ratio sees, or through the
deterministic denoising steps the ratio does not see?

LOOP (``pi0.ript.objectives.PPOObjective``) samples each chunk with one stochastic denoising step k (Flow-SDE) and
clips the ratio of that one Gaussian transition. The other N - 1 steps are Euler steps of the same network, so an
update that changes step k's mean also changes every later velocity, and the executed action moves by both. The clip
and the approx KL bound only the first part. This script measures the two parts for a report's RL snapshots, against
its start (``--against previous``: each against the snapshot before it), on observations the start visits:

1. The start rolls out (Flow-SDE, the run's noise level, step and kind, the way RL collects) once from each of
   ``--states`` validation init states of the run (``val_start`` on), and every decision is kept with its chain.
2. For each snapshot Q of the arm, on each decision's recorded x_0 and noise draw (the start P recorded them):
   - ``seen``: P's chain with only step k's mean taken from Q (what the ratio compares), carried to the action by
     P's Euler steps;
   - ``moved``: Q's whole chain on the same x_0 and noise draw;
   - ``unseen`` = moved - seen: what Q's other steps add;
   - ``scored``: Q's deterministic (Euler) action minus P's from the same x_0, the policy every arm is scored with
     (also per env action dim: its mean and RMS);
   - ``kl``: the exact KL of step k's two Gaussians, summed over the executed rows x env action dims (what LOOP's
     approx KL estimates), averaged over decisions.
   Each action figure is the root mean square over the executed rows x env action dims, in the model's normalized
   action space (where step k's std is 1 at noise level 1 and step 0).

Writes ``<run>/<arm>/drift.json`` (``drift_previous.json``; or ``--out``) and prints one row per snapshot:

    .venv/bin/python bench/rl_drift.py --run runs/bench_rl/task1_seed1_core_each
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the report's Config, start and runner
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pi0.models.flow_sde import (EVERY_STEP, chain_coefficients, check_sde, sde_integrate,  # noqa: E402
                                 sde_step_moments, sde_times)
from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.ript.collection import sde_collector  # noqa: E402
from pi0.ript.objectives import PPOObjective  # noqa: E402
from pi0.utils.cli import parse_config  # noqa: E402

Velocity = Callable[[int, torch.Tensor], torch.Tensor]  # (denoising step j, x_j (B,H,A)) -> v (B,H,A)


def euler(velocity: Velocity, x: torch.Tensor, num_steps: int) -> torch.Tensor:
    """x (B,H,A) at t = 1 -> the deterministic action after the N Euler steps of ``velocity`` (B,H,A)."""
    for j in range(num_steps):
        x = x - velocity(j, x) / num_steps  # as PI0Model.sample_actions: x_{t-d} = x_t - d v (t decreasing)
    return x


def recorded_noise(vel: Velocity, chain: torch.Tensor, k: int, noise_level: float, kind: str = "flow_sde"
                   ) -> torch.Tensor:
    """The N(0,1) draw (B,H,A) of step k in a Flow-SDE chain (B,N+1,H,A) the policy of ``vel`` recorded:
    (chain[:, k+1] - mean_k(chain[:, k])) / std_k."""
    n = chain.shape[1] - 1
    mean, std = sde_step_moments(chain[:, k], vel(k, chain[:, k]), sde_times(n)[k], 1.0 / n, noise_level, kind)
    return (chain[:, k + 1] - mean) / std


def split_drift(vel_p: Velocity, vel_q: Velocity, x0: torch.Tensor, eps: torch.Tensor, k: int, num_steps: int,
                noise_level: float, kind: str = "flow_sde") -> dict[str, torch.Tensor]:
    """Policies P and Q (their velocities), the chain's start x0 and step k's N(0,1) draw eps (B,H,A) ->
    {"start": P's Flow-SDE action, "seen": P's chain with step k's mean taken from Q (at P's x_k), "moved": Q's
    chain, "scored_p"/"scored_q": each one's Euler (deterministic) action from x0 (all (B,H,A)), "mean_shift":
    Q's step-k mean minus P's at P's x_k (B,H,A), "std": step k's std}; every chain on the same x0 and eps, each run
    by the samplers' own loop (``flow_sde.sde_integrate``)."""
    coefs = chain_coefficients(num_steps, k, noise_level, x0, kind)

    def chain(vel: Velocity) -> torch.Tensor:  # (B,N+1,H,A)
        return sde_integrate(vel, x0, num_steps, k, coefs, lambda: eps)[0]

    start, moved = chain(vel_p), chain(vel_q)
    seen = chain(lambda j, x: (vel_q if j == k else vel_p)(j, x))  # P's steps, Q's velocity at step k only
    # seen and start share x_k and eps, so their step-k outputs differ by exactly the two means' difference
    return {"start": start[:, -1], "seen": seen[:, -1], "moved": moved[:, -1], "scored_p": euler(vel_p, x0, num_steps),
            "scored_q": euler(vel_q, x0, num_steps), "mean_shift": seen[:, k + 1] - start[:, k + 1], "std": coefs[2]}


def drift_sums(parts: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float | np.ndarray]:
    """:func:`split_drift`'s parts and the executed mask (B,H,A) -> sums over the masked entries of the squared
    seen / unseen / moved / scored moves, the step's KL summed over them per decision and summed over decisions, the
    counts ("entries", "decisions"), and per action dim (A,) the scored move's sum and sum of squares and the count:
    add them over batches, then :func:`drift_figures`."""
    m = mask.to(parts["start"].dtype)
    sq = lambda d: float((d * d * m).sum())  # noqa: E731
    kl = ((parts["mean_shift"] / parts["std"]) ** 2 / 2 * m).flatten(1).sum(-1)  # (B,): KL of equal-std Gaussians
    scored = parts["scored_q"] - parts["scored_p"]
    per_dim = lambda d: (d * m).flatten(0, 1).sum(0).double().numpy()  # noqa: E731  (B,H,A) -> (A,)
    return {"seen": sq(parts["seen"] - parts["start"]), "unseen": sq(parts["moved"] - parts["seen"]),
            "moved": sq(parts["moved"] - parts["start"]), "scored": sq(scored),
            "kl": float(kl.sum()), "entries": float(m.sum()), "decisions": float(m.shape[0]),
            "scored_dim": per_dim(scored), "scored_dim_sq": per_dim(scored * scored), "entries_dim": per_dim(m)}


def drift_figures(sums: dict[str, float | np.ndarray]) -> dict[str, float | list[float]]:
    """Summed :func:`drift_sums` -> RMS per masked entry of each move, mean KL per decision, the unseen part's share
    of seen^2 + unseen^2, and per executed action dim the scored move's mean and RMS."""
    out: dict[str, float | list[float]] = {
        k: float(np.sqrt(sums[k] / sums["entries"])) for k in ("seen", "unseen", "moved", "scored")}
    out["kl"] = sums["kl"] / sums["decisions"]
    out["unseen_share"] = sums["unseen"] / max(sums["seen"] + sums["unseen"], 1e-30)
    n = sums["entries_dim"]
    dims = n > 0  # the env's action dims (the padding is never executed)
    out["scored_mean_per_dim"] = (sums["scored_dim"][dims] / n[dims]).tolist()
    out["scored_rms_per_dim"] = np.sqrt(sums["scored_dim_sq"][dims] / n[dims]).tolist()
    return out


@dataclass
class Config:
    run: str = ""  # a report's --out (its rl_improvement.json names the start and the validation states)
    arm: str = "rl"  # the arm whose snapshots are measured
    states: int = 100  # validation init states per task, one start rollout each
    batch: int = 256  # decisions per forward batch
    seed: int = 0  # the collection's noise
    against: str = "start"  # each snapshot against the start, or "previous": against the snapshot before it
    out: str = ""  # default: <run>/<arm>/drift[_previous].json


def velocity_of(policy: PI0Policy, batch: dict[str, torch.Tensor]) -> Velocity:
    """The policy's v at denoising step j's time on a collated batch's observations, on one prefix pass (its kv cache
    serves every step, as in ``PI0Model.sample_actions``)."""
    times = sde_times(policy.config.num_steps)
    model = policy.model
    kv_cache, prefix_pad = model.encode_prefix(batch["images"], batch["img_masks"], batch["lang_tokens"],
                                               batch["lang_masks"])

    def v(j: int, x: torch.Tensor) -> torch.Tensor:
        t = torch.full((x.shape[0],), times[j], device=x.device)
        return model.denoise_step(kv_cache, prefix_pad, batch["state"], x, t)
    return v


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(Config, argv)
    run = Path(cfg.run)
    report = run / "rl_improvement.json"
    if not report.is_file():
        raise SystemExit(f"error: --run {cfg.run!r} has no rl_improvement.json (give a bench/rl_improvement.py --out)")
    arm_json = run / cfg.arm / "arm.json"
    if not arm_json.is_file():
        raise SystemExit(f"error: {arm_json} not found: --arm must be an arm the report ran (rl, sft, rft)")
    if cfg.against not in ("start", "previous"):
        raise SystemExit(f"error: --against must be start or previous, got {cfg.against!r}")
    import rl_improvement as rli  # noqa: E402  (bench/: heavy imports only after the checks)

    names = {f.name for f in fields(rli.Config)}
    rcfg = rli.Config(**{k: v for k, v in json.loads(report.read_text())["config"].items() if k in names})
    rcfg.arm = ""
    if not 1 <= cfg.states <= rcfg.eval_start - rcfg.val_start:  # never a held-out state
        raise SystemExit(f"error: --states must be in 1..{rcfg.eval_start - rcfg.val_start} (the validation states "
                         f"{rcfg.val_start}..{rcfg.eval_start - 1} before the held-out ones), got {cfg.states}")
    arm = json.loads(arm_json.read_text())
    st = arm["settings"]
    noise, k, kind = float(st.get("noise_level", rcfg.noise_level)), int(st.get("sde_step", rcfg.sde_step)), \
        st.get("sde_kind", rcfg.sde_kind)
    if k < 0:
        why = "every step: its ratio saw the whole chain" if k == EVERY_STEP else "a step drawn per call"
        raise SystemExit(f"error: the arm's sde_step is {k} ({why}); this split needs one fixed step")
    torch.set_num_threads(max(1, rcfg.threads))
    start, _, root, rec = rli.start(rcfg)
    check_sde(kind, noise, k, start.config.num_steps)
    states = [(t, i) for t in rcfg.task for i in range(rcfg.val_start, rcfg.val_start + cfg.states)]
    runner = rli.make_runner(rcfg, start, num_envs=min(len(states), 64))
    start.model.enable_fast_sampling(True)
    episodes = runner.run(states, group_size=1, policy=sde_collector(start, noise, k,
                                                                      torch.Generator().manual_seed(cfg.seed), kind))
    runner.close()
    start.model.enable_fast_sampling(False)
    objective = PPOObjective(start, noise, sde_kind=kind)
    windows = [w for ep in episodes for w in objective.episode_windows(ep)]
    success = float(np.mean([e.success for e in episodes]))
    print(f"start {root.name}: {len(episodes)} validation rollouts (success {success:.2f}), {len(windows)} decisions, "
          f"stochastic step {k}, noise level {noise}, {kind}", flush=True)
    batches = []  # collated once; each with the start's velocity and its recorded step-k noise draw
    with torch.no_grad():
        for b0 in range(0, len(windows), cfg.batch):
            batch = objective.collate(windows[b0:b0 + cfg.batch])
            vel_start = velocity_of(start, batch)
            batches.append((batch, vel_start, recorded_noise(vel_start, batch["chain"], k, noise, kind)))
    snaps = sorted(p for p in (run / cfg.arm).glob("snap*") if (p / "model.safetensors").is_file())
    minutes = [c["minutes"] for c in arm.get("curve", [])]  # the snapshots in order (evaluated ones, each saved)
    rows, prev = [], start
    for j, path in enumerate(snaps):
        q = PI0Policy.from_pretrained(path)
        p = start if cfg.against == "start" else prev
        sums: dict[str, float | np.ndarray] = {}
        with torch.no_grad():
            for batch, vel_start, eps in batches:
                parts = split_drift(vel_start if p is start else velocity_of(p, batch), velocity_of(q, batch),
                                    batch["chain"][:, 0], eps, k, start.config.num_steps, noise, kind)
                for name, val in drift_sums(parts, batch["action_mask"]).items():
                    sums[name] = sums.get(name, 0.0) + val
        row = {"snapshot": path.name, "minutes": minutes[j] if j < len(minutes) else None,
               "against": "start" if p is start else snaps[j - 1].name, **drift_figures(sums)}
        rows.append(row)
        prev = q
        print(f"{path.name} ({row['minutes'] or 0:.1f} min) against {row['against']}: seen {row['seen']:.3f}  "
              f"unseen {row['unseen']:.3f}  moved {row['moved']:.3f}  scored {row['scored']:.3f}  "
              f"step-{k} KL {row['kl']:.4f}  unseen share of the squared move {row['unseen_share']:.2f}\n"
              f"  scored move per action dim, mean: {' '.join(f'{v:+.3f}' for v in row['scored_mean_per_dim'])}"
              f"  RMS: {' '.join(f'{v:.3f}' for v in row['scored_rms_per_dim'])}", flush=True)
    out = Path(cfg.out) if cfg.out else run / cfg.arm / f"drift{'' if cfg.against == 'start' else '_previous'}.json"
    result = {"run": str(run), "arm": cfg.arm, "start": root.name, "start_plateau": rec.get("plateau"),
              "states": len(states), "rollout_success": success, "decisions": len(windows), "sde_step": k,
              "noise_level": noise, "sde_kind": kind, "settings": st, "against": cfg.against, "snapshots": rows}
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
