r"""Bench: does RL improve a *converged* few-shot pi0 beyond what its demonstrations give? (arena or MetaWorld, CPU)

Protocol:
1. Start: a tiny pi0 (same architecture, small sizes) trained by SFT on ``--num_demos`` scripted-expert demos per task
   until success on ``--val_states`` validation init states (the mean of the last ``--smooth`` checks) has not improved
   for ``--patience`` checks (counted once it has first succeeded; every ``--check_every`` steps; the best weights
   are kept; reaching ``--sft_steps`` first is an error unless ``--no-require_convergence``; rerun with a higher cap
   and the start resumes from its last check). Cached by config hash. A plateau outside ``--plateau_band``
   (0.15-0.5) scales N by 0.75 (above) or 4/3 (below) and retrains, at most 3 times.
2. Arms, each in its own process from the same start, each for ``--minutes`` of wall-clock, either side by side
   (``--arm_schedule side_by_side``: they share the machine's 2 cores, about 2/3 of a core each) or each pinned to a
   core of its own (``core_each``: RL and SFT at once, then RFT; an arm runs one torch thread, and a second thread
   does not speed up the tiny policy): ``rl`` (``pi0.ript.trainer.RIPTTrainer``, ``--objective`` ppo | cfg), ``sft``
   (continued SFT on the same demos), ``rft`` (SFT on the demos plus the policy's own successful rollouts, collected
   as the RL arm collects; ``pi0.ript.warm_start.rft``). No arm gets new demos. Each arm saves ``--snapshots``
   checkpoints along its budget and evaluates them afterwards (the intermediate ones on the first ``--curve_states``
   held-out states per task when it is set: the curve's shape for less evaluation time; the last one on all).
3. Evaluation: success on ``--eval_states`` held-out init states per task (disjoint from the training and validation
   states), openpi's deterministic sampler with each episode's noise keyed to the episode (the same noise for every
   policy: paired), with the standard error sqrt(p (1 - p) / n) of each rate and the paired standard error of
   RL − max(SFT, RFT) (``pi0.evaluation.paired``).

Settings are chosen on validation states only (``--stage tune``): round j runs every arm side by side with the j-th
entry of its grid (``--tune_rl``, ``--tune_sft``, ``--tune_rft``: the same number of points and the same minutes for
each arm), scores each arm's final weights on the ``--val_states`` validation states (``--tune_states``: more of them
than the start's checks use), and writes ``<out>/tune.json`` with every score and each arm's best entry. Held-out
states are not built in that stage. ``--stage report --tuned <tune.json>`` runs the arms with those entries and
evaluates on held-out states (states 1600-1999 were seen by earlier probes, so the held-out default starts at 2000).
``--stage select --out <report dir>`` then selects each arm's checkpoint as early stopping would, every arm alike:
each snapshot scored on the validation states, the best kept and evaluated on every held-out state
(``<out>/selected.json``, paired differences of the selected policies).
``--stage start`` only builds (or loads) the cached start, the band search included, and prints its record.

Writes ``<out>/rl_improvement.json`` and ``.png`` (held-out success against wall-clock, every arm). The last line is
``before=<p> after=<p> sft=<p> rft=<p> w1=<p> minutes=<m>`` (w1: the RL policy at w=1; equals ``after`` for ppo).
``bench/rl_table.py`` collects reports into one table and refuses a replayed seed.

    nice -n 10 .venv/bin/python bench/rl_improvement.py --stage tune --minutes 10 --out runs/bench_rl/tune
    nice -n 10 .venv/bin/python bench/rl_improvement.py --seed 0 --minutes 20 --tuned runs/bench_rl/tune/tune.json \
        --out runs/bench_rl/seed0
    .venv/bin/python bench/rl_improvement.py --env metaworld --task 1 2 5 --num_demos 20 --minutes 40 --eval_states 70 \
        --train_states 200 --val_start 200 --val_states 20 --eval_start 250 --curve_states 20 --snapshots 4 \
        --sft_steps 20000 --tuned bench/results/rl_tune.json --out runs/bench_rl_mw/seed0
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pi0, not an installed one

from pi0.evaluation.paired import paired_difference, per_task, rate_se as se  # noqa: E402
from pi0.models.flow_sde import check_sde, sampler_step  # noqa: E402
from pi0.modeling_pi0 import PI0Policy  # noqa: E402
from pi0.models.pi0 import TRAINABLE  # noqa: E402
from pi0.ript.objectives import OBJECTIVES, FlowMatchingObjective  # noqa: E402
from pi0.ript.init_states import InitStateSampler  # noqa: E402
from pi0.ript.trainer import RIPTTrainer, RLConfig  # noqa: E402
from pi0.ript.update import LR_SCHEDULES, OptimizerConfig, PolicyUpdate, lr_scale_at  # noqa: E402
from pi0.ript.warm_start import (  # noqa: E402
    ENVS, Plateau, TinyArenaConfig, cached_warm_start, env_runner, evaluate_episodes, rft, sft)
from pi0.utils.cli import parse_config  # noqa: E402
from pi0.utils.machine import machine  # noqa: E402
from rl_table import goal_met  # noqa: E402  (bench/: the goals the table judges by)

ARMS = ("rl", "sft", "rft")
# the settings each arm's tuning grid may set (one name per setting; the arms share none of them)
ARM_SETTINGS = {"rl": ("lr", "epochs", "minibatch_size", "noise_level", "sde_step", "sde_kind", "clip",
                       "rl_schedule", "trainable", "episode_mean", "demo_coef"),
                "sft": ("sft_arm_lr", "sft_schedule"),
                "rft": ("rft_lr", "rft_schedule", "rft_steps_per_iteration")}
STAGES = ("start", "tune", "report", "select")
# how the arms share the machine: all at once on its cores, or each on a core of its own (at most one arm per core at
# a time; an arm that finds no free core waits for one)
ARM_SCHEDULES = ("side_by_side", "core_each")


@dataclass
class Config:
    """Bench options."""

    env: str = "arena"  # "arena" | "metaworld" (MT10 task ids)
    task: list[int] = field(default_factory=lambda: [4])  # task id(s) of the env
    seed: int = 0
    minutes: float = 20.0  # wall-clock of each arm
    # side_by_side: the three arms at once, sharing every core (on 2 cores each gets about 2/3 of one); core_each: each
    # arm pinned to a core of its own for its budget (on 2 cores: RL and SFT, then RFT); the tune stage runs alike
    arm_schedule: str = "side_by_side"
    objective: str = "ppo"  # the RL arm's objective: ppo | cfg (pi0.ript.objectives)
    # the start
    num_demos: int = 200  # expert demos per task (init states 0..n-1); 200 -> a plateau near 0.4 on task 4
    # the start's validation plateau must lie in [lo, hi] (the 0.15-0.5): outside it, N is scaled by 0.75
    # (above) or 4/3 (below) and the start retrained, at most 3 times ([]: take num_demos as given)
    plateau_band: list[float] = field(default_factory=lambda: [0.15, 0.5])
    sft_steps: int = 10000  # most warm-start SFT steps
    check_every: int = 250  # SFT steps between validation checks
    patience: int = 8  # checks without a new best before the start counts as converged
    smooth: int = 3  # the start's criterion: the mean of the last `smooth` validation checks (1: the single check)
    require_convergence: bool = True  # a start that reaches --sft_steps before its patience runs out is an error
    # patience counts only once the start's criterion has been above 0 (checks at 0 before it first succeeds are not
    # a plateau; without it, a slow start stopped there with a plateau of 0, 2,750 steps in)
    patience_from_success: bool = True
    sft_lr: float = 1e-3  # the warm start's lr
    # > 0: the start ends with this many SFT steps from its plateau weights, the lr decayed linearly to 0
    # (pi0.ript.warm_start.cool_down; make run's preset uses 1000); 0: the plateau's weights as they are
    start_cooldown: int = 0
    # the arms' optimizers (tuned on validation states: --stage tune); every arm starts a fresh AdamW warmed up
    # linearly over warmup_steps; a *_schedule of "cosine" decays the arm's lr to 0 over its wall-clock budget
    sft_arm_lr: float = 1e-3  # continued SFT
    rft_lr: float = 1e-3  # RFT
    sft_schedule: str = "constant"
    rft_schedule: str = "constant"
    rl_schedule: str = "constant"
    warmup_steps: int = 50
    # init-state split per task: training 0..train_states-1 (the demos' states included), validation
    # val_start..val_start+val_states-1, held-out eval_start..eval_start+eval_states-1
    train_states: int = 1500
    val_start: int = 1500
    val_states: int = 100
    # validation states per task the tune stage scores, from val_start (0: val_states, the start's own checks); more
    # than val_states reaches past the start's checks, never into the held-out range
    tune_states: int = 0
    eval_start: int = 2000  # 1600-1999 were scored by earlier probes of the RL settings: not held out any more
    eval_states: int = 400
    # tuning: "tune" scores grid points on validation states; "report" evaluates on held-out states; "select" (after
    # a report in --out) picks each arm's snapshot by validation success and evaluates that one on held-out states
    stage: str = "report"
    tuned: str = ""  # report: a tune.json whose best entry per arm this run uses
    tune_rl: list[str] = field(default_factory=lambda: ["lr=3e-6", "lr=1e-5", "lr=3e-5", "lr=1e-5,rl_schedule=cosine"])
    tune_sft: list[str] = field(default_factory=lambda: [
        "sft_arm_lr=1e-4", "sft_arm_lr=3e-4", "sft_arm_lr=1e-3", "sft_arm_lr=3e-4,sft_schedule=cosine"])
    tune_rft: list[str] = field(default_factory=lambda: [
        "rft_lr=1e-4", "rft_lr=3e-4", "rft_lr=1e-3", "rft_lr=3e-4,rft_schedule=cosine"])
    point: int = -1  # internal: the grid point an arm runs in the tune stage
    # RL
    num_groups: int = 4
    group_size: int = 8
    lr: float = 1e-5
    epochs: int = 1
    minibatch_size: int = 32
    trainable: str = "all"
    noise_level: float = 1.0  # ppo (and the RFT arm's collection, which collects as RL does)
    sde_step: int = 0  # ppo: the stochastic denoising step (-1: uniform per decision batch, -2: every step;
    # RLConfig.sde_step)
    sde_kind: str = "flow_sde"  # ppo (and RFT's collection): the step's transition, flow_sde | cps (RLConfig.sde_kind)
    clip: float = 0.2  # ppo
    episode_mean: bool = False  # each episode's windows share its advantage (RLConfig.episode_mean)
    demo_coef: float = 0.0  # the RL update's flow-matching term on the start's demos (RLConfig.demo_coef)
    value_baseline: bool = False  # ppo: the value head's per-decision baseline (RLConfig.value_baseline)
    value_lr: float = 1e-3  # ppo with value_baseline: the value head's lr
    p_uncond: float = 0.3  # cfg
    cfg_guidance: float = 1.5  # cfg: the w the RL arm collects and is evaluated with
    # RFT
    rft_steps_per_iteration: int = 8
    snapshots: int = 6  # checkpoints per arm along its budget (the curve)
    # held-out states per task for the curve's intermediate snapshots (0: all eval_states); the final snapshot, and so
    # the summary line, always uses all eval_states
    curve_states: int = 0
    # envs per runner (0: 2 x num_groups x group_size, so that an oversampled round has every group in flight; the
    # arena in process, MetaWorld spread over `workers` processes)
    num_envs: int = 0
    workers: int = 2  # MetaWorld: env worker processes (num_envs / workers envs in each)
    overlap: bool = False  # MetaWorld: one half of the env processes steps while the policy decides for the other
    oversample: float = 1.0  # dynamic sampling: groups started per round / groups expected to be kept (RLConfig)
    fast_sampling: bool = True  # collect and evaluate through FastSampler (RLConfig.fast_sampling)
    threads: int = 1  # torch threads per process (1 is fastest on a loaded 2-core machine)
    out: str = "runs/bench_rl"
    arm: str = ""  # internal: run one arm ("rl" | "sft" | "rft") in this process


def splits(cfg: Config) -> tuple[list, list, dict]:
    """Validation and held-out (task, id) lists, and the training states per task; refuses overlaps and bad
    options (one line each, before any work)."""
    n_val = max(cfg.val_states, cfg.tune_states)
    if not (cfg.num_demos <= cfg.train_states <= cfg.val_start and cfg.val_start + n_val <= cfg.eval_start):
        raise SystemExit(f"error: the init-state split overlaps: need num_demos ({cfg.num_demos}) <= train_states "
                         f"({cfg.train_states}) <= val_start ({cfg.val_start}) and val_start + max(val_states, "
                         f"tune_states) ({cfg.val_start + n_val}) <= eval_start ({cfg.eval_start})")
    if cfg.objective not in OBJECTIVES:
        raise SystemExit(f"error: --objective must be one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.env not in ENVS:
        raise SystemExit(f"error: --env must be one of {ENVS}, got {cfg.env!r}")
    n_tasks = 5 if cfg.env == "arena" else 10
    if not cfg.task or any(not 0 <= t < n_tasks for t in cfg.task):
        raise SystemExit(f"error: unknown {cfg.env} task id(s) in --task {cfg.task}; valid ids are 0..{n_tasks - 1}")
    if cfg.stage not in STAGES:
        raise SystemExit(f"error: --stage must be one of {STAGES}, got {cfg.stage!r}")
    if cfg.arm_schedule not in ARM_SCHEDULES:
        raise SystemExit(f"error: --arm_schedule must be one of {ARM_SCHEDULES}, got {cfg.arm_schedule!r}")
    for name in ("sft_schedule", "rft_schedule", "rl_schedule"):
        if getattr(cfg, name) not in LR_SCHEDULES:
            raise SystemExit(f"error: --{name} must be one of {LR_SCHEDULES}, got {getattr(cfg, name)!r}")
    if not -2 <= cfg.sde_step < TinyArenaConfig.num_steps:
        raise SystemExit(f"error: --sde_step must be -1 (drawn), -2 (every step) or a denoising step "
                         f"0..{TinyArenaConfig.num_steps - 1} of the bench's {TinyArenaConfig.num_steps}-step policy, "
                         f"got {cfg.sde_step}")
    check_sde_settings(cfg, {}, "--noise_level / --sde_step / --sde_kind")
    if cfg.demo_coef < 0:
        raise SystemExit(f"error: --demo_coef must be >= 0 (0: no demo anchor), got {cfg.demo_coef}")
    if cfg.stage == "tune" and cfg.tuned:
        raise SystemExit("error: --tuned applies to --stage report; the tune stage writes tune.json")
    grid(cfg)
    if cfg.tuned:
        tuned_entries(cfg)
    val = [(t, i) for t in cfg.task for i in range(cfg.val_start, cfg.val_start + cfg.val_states)]
    held = [(t, i) for t in cfg.task for i in range(cfg.eval_start, cfg.eval_start + cfg.eval_states)]
    return val, held, {t: range(cfg.train_states) for t in cfg.task}


def tune_scored(cfg: Config) -> list[tuple[int, int]]:
    """The validation (task, id) states the tune stage scores: ``--tune_states`` per task from ``--val_start``
    (default: the start's ``--val_states``)."""
    n = cfg.tune_states or cfg.val_states
    return [(t, i) for t in cfg.task for i in range(cfg.val_start, cfg.val_start + n)]


def parse_entry(entry: str, arm: str) -> dict[str, Any]:
    """A grid entry ``"key=value[,key=value]"`` of ``arm`` -> {setting: typed value} (only the arm's own settings)."""
    kinds = {f.name: type(f.default) for f in fields(Config) if f.default is not MISSING}
    out: dict[str, Any] = {}
    for item in filter(None, entry.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ARM_SETTINGS[arm]:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: {item!r} is not key=value with a key of the {arm} "
                             f"arm ({', '.join(ARM_SETTINGS[arm])})")
        try:
            if kinds[key] is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = kinds[key](value)
        except ValueError:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: {value!r} is not a {kinds[key].__name__}") from None
        if key.endswith("_schedule") and out[key] not in LR_SCHEDULES:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: {key} must be one of {LR_SCHEDULES}")
        if key == "demo_coef" and out[key] < 0:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: demo_coef must be >= 0")
        if key == "trainable" and out[key] not in TRAINABLE:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: trainable must be one of {TRAINABLE}")
        if key == "sde_step" and not -2 <= out[key] < TinyArenaConfig.num_steps:
            raise SystemExit(f"error: --tune_{arm} entry {entry!r}: sde_step must be -1 (drawn), -2 (every step) or a "
                             f"denoising step 0..{TinyArenaConfig.num_steps - 1} of the bench's "
                             f"{TinyArenaConfig.num_steps}-step policy")
    return out


def check_sde_settings(cfg: Config, entry: dict[str, Any], where: str) -> None:
    """One-line error where the RL arm's stochastic step (``cfg``'s, overridden by a grid ``entry``) cannot be
    made: an unknown kind, a cps eta outside (0, 1], cps at the last denoising step."""
    s = {k: entry.get(k, getattr(cfg, k)) for k in ("noise_level", "sde_step", "sde_kind")}
    try:
        check_sde(s["sde_kind"], s["noise_level"], sampler_step(s["sde_step"]),
                  TinyArenaConfig.num_steps)
    except ValueError as e:
        raise SystemExit(f"error: {where}: {e}") from None


def grid(cfg: Config) -> dict[str, list[str]]:
    """Each arm's tuning entries; the same number for every arm (the same tuning effort), each one valid."""
    g = {"rl": cfg.tune_rl, "sft": cfg.tune_sft, "rft": cfg.tune_rft}
    sizes = {arm: len(v) for arm, v in g.items()}
    if len(set(sizes.values())) != 1 or not cfg.tune_rl:
        raise SystemExit(f"error: every arm's tuning grid needs the same number (>= 1) of entries (the same effort "
                         f"per arm), got {sizes}")
    for arm, entries in g.items():
        for e in entries:
            parsed = parse_entry(e, arm)
            if arm == "rl":
                check_sde_settings(cfg, parsed, f"--tune_rl entry {e!r}")
    return g


def tuned_entries(cfg: Config) -> dict[str, str]:
    """The best entry per arm of ``--tuned``; refuses a tune.json whose validation states reach this run's
    held-out states."""
    path = Path(cfg.tuned)
    if not path.is_file():
        raise SystemExit(f"error: --tuned {path}: no such file (run --stage tune first; it writes <out>/tune.json)")
    rec = json.loads(path.read_text())
    if set(rec.get("best", {})) != set(ARMS):
        raise SystemExit(f"error: --tuned {path}: no best entry for every arm {ARMS}")
    lo, hi = rec["val_range"]
    if rec["env"] == cfg.env and set(rec["task"]) & set(cfg.task) and lo < cfg.eval_start + cfg.eval_states \
            and cfg.eval_start < hi:
        raise SystemExit(f"error: --tuned {path} chose its settings on states {lo}..{hi - 1}, which overlap this "
                         f"run's held-out states {cfg.eval_start}..{cfg.eval_start + cfg.eval_states - 1}")
    for arm in ARMS:
        parse_entry(rec["best"][arm], arm)
    return rec["best"]


def arm_config(cfg: Config, arm: str) -> Config:
    """The bench's options with ``arm``'s settings: its grid point (tune stage) or its tuned entry (``--tuned``)."""
    if cfg.stage == "tune":
        return replace(cfg, **parse_entry(grid(cfg)[arm][cfg.point], arm))
    if cfg.tuned:
        return replace(cfg, **parse_entry(tuned_entries(cfg)[arm], arm))
    return cfg


def reported_guidance(cfg: Config, arm: str) -> float | None:
    """The w an arm is scored and reported at: the RL arm's ``cfg_guidance`` under ``--objective cfg``, else None."""
    return cfg.cfg_guidance if arm == "rl" and cfg.objective == "cfg" else None


def num_init_states(cfg: Config) -> int:
    return cfg.eval_start + cfg.eval_states


def tiny_config(cfg: Config) -> TinyArenaConfig:
    """The tiny pi0 of the bench (MetaWorld's longer prompts get 32 tokens)."""
    return TinyArenaConfig(seed=cfg.seed, max_token_len=24 if cfg.env == "arena" else 32)


def make_runner(cfg: Config, policy: PI0Policy, num_envs: int = 0, resolution: int = 64,
                max_steps: int | None = None):
    """A runner of the bench's env: ``--num_envs`` envs, else ``num_envs``, else 2 x num_groups x group_size
    (MetaWorld: over ``--workers`` processes), rendering at ``resolution`` px, episodes capped at ``max_steps``
    (None: the env's own cap)."""
    n = cfg.num_envs or num_envs or 2 * cfg.num_groups * cfg.group_size
    per = -(-n // max(1, cfg.workers))
    return env_runner(cfg.env, n, policy.config.n_action_steps, resolution, max_steps,
                      num_init_states=num_init_states(cfg), envs_per_worker=per, overlap=cfg.overlap)


def next_num_demos(n: int, plateau: float, band: list[float], max_n: int) -> int | None:
    """The next N to try when a start with ``n`` demos plateaus at ``plateau`` outside ``band`` = [lo, hi]: n x 0.75
    above, n x 4/3 below (a multiple of 10, and at least 10 away from n, so that a small N can leave the band's
    edge: 20 -> 10, not back to 20), within 10..max_n; None when inside the band (or no band, or nowhere to go)."""
    if not band or band[0] <= plateau <= band[1]:
        return None
    above = plateau > band[1]
    m = round(n * (0.75 if above else 4 / 3) / 10) * 10
    m = min(m, n - 10) if above else max(m, n + 10)
    m = min(max(10, m), max_n)
    return None if m == n else m


def start(cfg: Config) -> tuple[PI0Policy, list, Path, dict]:
    """The converged few-shot start (cached) + its demo windows, cache dir and record. Outside an arm, N is searched
    until the validation plateau lies in ``plateau_band`` (``cfg.num_demos`` is set to the N used; the record's
    ``tried`` lists every N and plateau)."""
    val, _, _ = splits(cfg)
    band = cfg.plateau_band
    if band and (len(band) != 2 or not 0.0 <= band[0] <= band[1] <= 1.0):
        raise SystemExit(f"error: --plateau_band takes two success rates lo <= hi in [0, 1] (or none), got {band}")
    tried = []
    while True:
        demos = [(t, i) for t in cfg.task for i in range(cfg.num_demos)]
        policy, windows, root = cached_warm_start(
            tiny_config(cfg), demos, cfg.sft_steps, OptimizerConfig(lr=cfg.sft_lr, minibatch_size=32),
            stop=Plateau(val, cfg.check_every, cfg.patience, smooth=cfg.smooth,
                         require_convergence=cfg.require_convergence,
                         patience_from_success=cfg.patience_from_success), env=cfg.env, cooldown=cfg.start_cooldown)
        rec = json.loads((root / "warm_start.json").read_text())
        tried.append({"demos": cfg.num_demos, "steps": rec["steps"], "plateau": rec["plateau"]})
        n = None if cfg.arm or len(tried) > 3 else next_num_demos(cfg.num_demos, rec["plateau"], band,
                                                                    cfg.train_states)
        if n is None:
            break
        print(f"start: {cfg.num_demos} demos plateau at {rec['plateau']:.3f} on validation, outside "
              f"{band}: retraining with {n} demos", flush=True)
        cfg.num_demos = n
    return policy, windows, root, {**rec, "tried": tried}


class Snapshots:
    """Saves the policy at ``n`` evenly spaced marks of a ``seconds`` budget (and at its end, unless the last mark
    already saved the final weights)."""

    def __init__(self, out: Path, seconds: float, n: int):
        self.out, self.seconds, self.n = out, seconds, n
        self.t0 = time.perf_counter()
        self.saved: list[dict] = []
        self.unsaved = True  # the weights changed since the last snapshot

    def maybe(self, policy: PI0Policy, final: bool = False) -> None:
        """Called after each training step (``final``: after the last); saves when a mark has passed."""
        el = time.perf_counter() - self.t0
        if (final and self.unsaved) or (not final and el >= self.seconds * (len(self.saved) + 1) / self.n):
            path = self.out / f"snap{len(self.saved):02d}"
            policy.save_pretrained(path)
            self.saved.append({"minutes": el / 60, "path": str(path)})
            self.unsaved = False
        elif not final:
            self.unsaved = True


def rl_config(cfg: Config) -> RLConfig:
    """The RL arm's settings from the bench's options (no evaluation during training)."""
    return RLConfig(objective=cfg.objective, trainable=cfg.trainable, noise_level=cfg.noise_level, clip=cfg.clip,
                    sde_step=cfg.sde_step, sde_kind=cfg.sde_kind, value_baseline=cfg.value_baseline,
                    episode_mean=cfg.episode_mean, demo_coef=cfg.demo_coef, num_groups=cfg.num_groups,
                    group_size=cfg.group_size, p_uncond=cfg.p_uncond, cfg_guidance=cfg.cfg_guidance, eval_every=0,
                    seed=cfg.seed, oversample=cfg.oversample, fast_sampling=cfg.fast_sampling,
                    opt=OptimizerConfig(lr=cfg.lr, epochs=cfg.epochs, minibatch_size=cfg.minibatch_size,
                                        value_lr=cfg.value_lr, warmup_steps=cfg.warmup_steps))


def arm_dir(cfg: Config, arm: str) -> Path:
    """Where an arm writes: ``<out>/<arm>``, or ``<out>/p<j>/<arm>`` for grid point j of the tune stage."""
    return Path(cfg.out) / (f"p{cfg.point}" if cfg.stage == "tune" else "") / arm


def run_arm(cfg: Config) -> None:
    """One arm in this process: train for ``minutes`` from the cached start, then evaluate its snapshots (tune
    stage: the final weights on validation states; report: every snapshot on held-out states)."""
    arm = cfg.arm
    cfg = arm_config(cfg, arm)
    policy, windows, _, _ = start(cfg)
    _, held, train_states = splits(cfg)
    scored = tune_scored(cfg) if cfg.stage == "tune" else held  # tuning never builds held-out states into anything
    out = arm_dir(cfg, arm)
    out.mkdir(parents=True, exist_ok=True)
    seconds = cfg.minutes * 60
    runner = make_runner(cfg, policy)
    snaps = Snapshots(out, seconds, 1 if cfg.stage == "tune" else cfg.snapshots)
    began = time.time()  # the training's wall-clock interval and cores, for who shared the machine with whom
    log: list[dict] = []
    schedule = {"rl": cfg.rl_schedule, "sft": cfg.sft_schedule, "rft": cfg.rft_schedule}[arm]
    upd: PolicyUpdate | None = None

    def callback(st: dict) -> None:
        el = time.perf_counter() - snaps.t0
        log.append({"minutes": el / 60, **{k: v for k, v in st.items() if isinstance(v, float)}})
        if "rollout/success_rate" in st and (len(log) == 1 or int(log[-1]["minutes"]) > int(log[-2]["minutes"])):
            print(f"[{arm}] {log[-1]['minutes']:.1f} min, iteration {len(log)}: rollout success "
                  f"{st['rollout/success_rate']:.2f}", flush=True)
        if upd is not None:
            upd.lr_scale = lr_scale_at(schedule, el / seconds)
        snaps.maybe(policy)

    sampler = InitStateSampler(train_states, seed=cfg.seed + 1)
    if arm == "rl":
        trainer = RIPTTrainer(policy, runner, sampler, rl_config(cfg), demos=windows)
        upd = trainer.update
        trainer.train(10**9, seconds=seconds, callback=callback)
    elif arm == "rft":
        upd = PolicyUpdate(FlowMatchingObjective(policy), OptimizerConfig(
            lr=cfg.rft_lr, minibatch_size=32, warmup_steps=cfg.warmup_steps), seed=cfg.seed + 2)
        rft(policy, windows, runner, sampler, upd.config, seconds, cfg.num_groups, cfg.group_size, cfg.noise_level,
            cfg.rft_steps_per_iteration, seed=cfg.seed + 2, callback=callback, sde_step=cfg.sde_step,
            fast_sampling=cfg.fast_sampling, update=upd, sde_kind=cfg.sde_kind, rl_objective=cfg.objective)
    else:
        upd = PolicyUpdate(FlowMatchingObjective(policy), OptimizerConfig(
            lr=cfg.sft_arm_lr, minibatch_size=32, warmup_steps=cfg.warmup_steps), seed=cfg.seed + 3)
        while time.perf_counter() - snaps.t0 < seconds:
            sft(policy, windows, upd.config, steps=25, update=upd)
            callback({"steps": 25.0})
    trained = (time.perf_counter() - snaps.t0) / 60
    machine = {"trained_between": [began, time.time()], "cores": sorted(os.sched_getaffinity(0)),
               "load_after": os.getloadavg()[0]}
    snaps.maybe(policy, final=True)
    guid = [cfg.cfg_guidance, 1.0] if arm == "rl" and cfg.objective == "cfg" else [None]
    curve = []
    for j, s in enumerate(snaps.saved):
        last = j == len(snaps.saved) - 1
        if cfg.stage == "tune" and not last:
            continue  # tuning scores only the final weights, on validation states
        pol = PI0Policy.from_pretrained(s["path"])
        states = scored if last else curve_subset(cfg, held)
        outcomes = {str(w): evaluate_episodes(runner, pol, states, seed=cfg.seed + 100, guidance=w) for w in guid}
        point = {"minutes": s["minutes"], "states": len(states), **{w: float(o.mean()) for w, o in outcomes.items()}}
        if last:  # per-episode outcomes of the final weights: the paired differences
            point["outcomes"] = {w: o.astype(int).tolist() for w, o in outcomes.items()}
        curve.append(point)
    runner.close()
    settings = {k: getattr(cfg, k) for k in ARM_SETTINGS[arm]}
    (out / "arm.json").write_text(json.dumps({"arm": arm, "stage": cfg.stage, "settings": settings,
                                              "trained_minutes": trained, **machine, "iterations": len(log),
                                              "curve": curve, "log": log}, indent=1))


def curve_subset(cfg: Config, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The held-out states an intermediate snapshot is evaluated on: the first ``curve_states`` of each task."""
    if not cfg.curve_states or cfg.curve_states >= cfg.eval_states:
        return held
    return [(t, i) for t, i in held if i < cfg.eval_start + cfg.curve_states]


def run_arms(argv: list[str], extra: list[str], out: Path, schedule: str = "side_by_side") -> dict[str, dict]:
    """The three arms, each in its own process (``argv`` + ``extra``), as ``schedule`` (ARM_SCHEDULES) shares the
    machine -> each arm's arm.json (with the core it was pinned to, if any)."""
    # a slot per arm that may run at once: side by side every arm gets one, unpinned (None); core_each one per core
    free = [None] * len(ARMS) if schedule == "side_by_side" else sorted(os.sched_getaffinity(0))
    running: dict[str, tuple[subprocess.Popen, int | None]] = {}
    codes: dict[str, int] = {}
    for arm in ARMS:  # each arm starts in a free slot, in ARMS order
        while not free:
            time.sleep(0.2)
            for other, (p, slot) in list(running.items()):
                if p.poll() is not None:
                    codes[other] = p.returncode
                    free.append(slot)
                    del running[other]
        slot = free.pop(0)
        pin = None if slot is None else (lambda core=slot: os.sched_setaffinity(0, {core}))  # before exec: every thread
        running[arm] = subprocess.Popen([sys.executable, __file__, *argv, *extra, "--arm", arm], preexec_fn=pin), slot
    codes.update({arm: p.wait() for arm, (p, _) in running.items()})
    failed = [arm for arm in ARMS if codes[arm] != 0]
    if failed:
        raise SystemExit(f"error: arm(s) {failed} failed; see their output above")
    return {arm: json.loads((out / arm / "arm.json").read_text()) for arm in ARMS}


def tune(cfg: Config, argv: list[str], val: list, before: float) -> dict:
    """The tune stage: every grid point's arms side by side, scored on validation states -> tune.json."""
    out = Path(cfg.out)
    g = grid(cfg)
    points: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for j in range(len(cfg.tune_rl)):
        print(f"tune: point {j}: " + ", ".join(f"{arm} {g[arm][j]}" for arm in ARMS), flush=True)
        arms = run_arms(argv, ["--num_demos", str(cfg.num_demos), "--point", str(j)], out / f"p{j}",
                        cfg.arm_schedule)
        for arm in ARMS:
            rate = arms[arm]["curve"][-1][str(reported_guidance(cfg, arm))]
            points[arm].append({"entry": g[arm][j], "val_success": rate, "iterations": arms[arm]["iterations"],
                                "trained_minutes": arms[arm]["trained_minutes"]})
            print(f"tune: point {j} {arm} ({g[arm][j]}): validation success {rate:.3f}", flush=True)
    best = {arm: max(points[arm], key=lambda p: p["val_success"])["entry"] for arm in ARMS}  # ties: the first
    rec = {"env": cfg.env, "task": cfg.task, "seed": cfg.seed, "minutes": cfg.minutes,
           "val_range": [val[0][1], val[-1][1] + 1], "val_states": len(val),
           "before": before, "points": points, "best": best}
    (out / "tune.json").write_text(json.dumps(rec, indent=1))
    print("tune: best " + ", ".join(f"{arm} {best[arm]}" for arm in ARMS) + f"; {out}/tune.json", flush=True)
    return rec


def select(out: Path) -> dict:
    """Checkpoint selection on validation states, every arm alike: score each snapshot of the report in ``out`` on the
    validation states, keep each arm's best (ties: the earliest) and evaluate it on every held-out state -> the
    paired differences of the selected policies, in ``<out>/selected.json``."""
    path = out / "rl_improvement.json"
    if not path.is_file():
        raise SystemExit(f"error: --stage select reads a report's {path}: no such file (run --stage report first)")
    rep = json.loads(path.read_text())
    cfg = replace(Config(), **{**rep["config"], "stage": "select", "out": str(out)})
    val, held, _ = splits(cfg)
    snaps = {arm: sorted((out / arm).glob("snap[0-9][0-9]")) for arm in ARMS}
    for arm in ARMS:
        if not snaps[arm] or len(snaps[arm]) != len(rep["arms"][arm]["curve"]):
            raise SystemExit(f"error: {out / arm} holds {len(snaps[arm])} snapshots, its report "
                             f"{len(rep['arms'][arm]['curve'])}")
    arms: dict[str, dict] = {}
    # the runner needs only the policy's chunking: any snapshot gives it (the start need not be cached here)
    with make_runner(cfg, PI0Policy.from_pretrained(snaps["rl"][0]), 50 if cfg.env == "arena" else 0) as r:
        for arm in ARMS:
            w = reported_guidance(cfg, arm)
            curve = rep["arms"][arm]["curve"]
            pols = [PI0Policy.from_pretrained(s) for s in snaps[arm]]
            scores = [float(evaluate_episodes(r, pol, val, seed=cfg.seed + 100, guidance=w).mean()) for pol in pols]
            j = int(np.argmax(scores))
            if "outcomes" in curve[j]:  # the final snapshot: the report already scored it on every held-out state
                outcomes = np.array(curve[j]["outcomes"][str(w)], dtype=float)
            else:
                outcomes = evaluate_episodes(r, pols[j], held, seed=cfg.seed + 100, guidance=w)
            arms[arm] = {"val_success": scores, "chosen": j, "minutes": curve[j]["minutes"],
                         "held_out": float(outcomes.mean()), "outcomes": outcomes.astype(int).tolist()}
            print(f"select: {arm} validation {' '.join(f'{x:.2f}' for x in scores)} -> snapshot {j} "
                  f"({curve[j]['minutes']:.1f} min): held-out {arms[arm]['held_out']:.3f}", flush=True)
    base = "sft" if arms["sft"]["held_out"] >= arms["rft"]["held_out"] else "rft"
    paired = {f"rl-{b}": dict(zip(("mean", "se"), paired_difference(arms["rl"]["outcomes"], arms[b]["outcomes"])))
              for b in ("sft", "rft")}
    rec = {"report": str(path), "val_states": len(val), "held_out_states": len(held), "before": rep["before"],
           "arms": arms, "paired": paired, "baseline": base}
    (out / "selected.json").write_text(json.dumps(rec, indent=1))
    d = paired[f"rl-{base}"]
    print(f"selected: before={rep['before']:.3f} rl={arms['rl']['held_out']:.3f} sft={arms['sft']['held_out']:.3f} "
          f"rft={arms['rft']['held_out']:.3f} rl-{base}={d['mean']:+.3f}+-{d['se']:.3f}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> dict:
    """Run the bench (or one arm with ``--arm``) and print the summary line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_config(Config, argv, __doc__)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.arm:
        if cfg.arm not in ARMS:
            raise SystemExit(f"error: --arm must be one of {ARMS}")
        return run_arm(cfg) or {}
    out = Path(cfg.out)
    if cfg.stage == "select":
        return select(out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    load0 = os.getloadavg()
    val, held, _ = splits(cfg)
    scored = tune_scored(cfg) if cfg.stage == "tune" else held
    policy, windows, root, rec = start(cfg)
    print(f"start: {cfg.num_demos} demos x {len(cfg.task)} task(s) ({len(windows)} windows), SFT {rec['steps']} steps "
          f"(best of {len(rec['curve'])} checks), validation plateau {rec['plateau']:.3f}, cached at {root}",
          flush=True)
    if cfg.stage == "start":  # build (or load) the cached start alone, e.g. ahead of the report that uses it
        return rec
    with make_runner(cfg, policy, 50 if cfg.env == "arena" else 0) as r:
        before_out = evaluate_episodes(r, policy, scored, seed=cfg.seed + 100)
    before, n = float(before_out.mean()), len(scored)
    where = "validation" if cfg.stage == "tune" else "held-out"
    print(f"before: {where} success {before:.3f} +- {se(before, n):.3f} ({n} init states)", flush=True)
    if len(cfg.task) > 1:  # a task the start already solves (or never solves) gives RL groups it discards
        rates = per_task(cfg.task, n // len(cfg.task), {"before": before_out.tolist()})
        print("before, per task: " + ", ".join(f"task {t} {r['before']:.3f}" for t, r in rates.items()), flush=True)
    if cfg.stage == "tune":
        return tune(cfg, argv, scored, before)
    arms = run_arms(argv, ["--num_demos", str(cfg.num_demos)], out, cfg.arm_schedule)
    key = str(reported_guidance(cfg, "rl"))
    final = {arm: arms[arm]["curve"][-1] for arm in ARMS}
    after = final["rl"][key]
    w1 = final["rl"]["1.0"] if cfg.objective == "cfg" else after
    sft_rate, rft_rate = final["sft"]["None"], final["rft"]["None"]
    outcomes = {"rl": final["rl"]["outcomes"][key], "sft": final["sft"]["outcomes"]["None"],
                "rft": final["rft"]["outcomes"]["None"]}
    base = "sft" if sft_rate >= rft_rate else "rft"  # the stronger baseline on the reported states
    paired = {f"rl-{b}": dict(zip(("mean", "se"), paired_difference(outcomes["rl"], outcomes[b])))
              for b in ("sft", "rft")}
    paired["rl-before"] = dict(zip(("mean", "se"), paired_difference(outcomes["rl"], before_out)))
    diff = paired[f"rl-{base}"]
    minutes = arms["rl"]["trained_minutes"]
    for arm, rate in (("rl", after), ("sft", sft_rate), ("rft", rft_rate)):
        print(f"{arm}: held-out success {rate:.3f} +- {se(rate, n):.3f} after {arms[arm]['trained_minutes']:.1f} min "
              f"({arms[arm]['settings']})", flush=True)
    print(f"RL - {base} (paired, {n} states, same noise): {diff['mean']:+.3f} +- {diff['se']:.3f}", flush=True)
    start_keys = ("demos", "steps", "plateau", "curve", "seconds", "tried")
    result = {"config": asdict(cfg), "start": {k: rec[k] for k in start_keys}, "tuned": cfg.tuned and
              json.loads(Path(cfg.tuned).read_text())["best"],
              "held_out_states": n, "before": before, "after": after, "w1": w1, "sft": sft_rate, "rft": rft_rate,
              "se": {k: se(v, n) for k, v in (("before", before), ("after", after), ("sft", sft_rate),
                                             ("rft", rft_rate))},
              "paired": paired, "baseline": base, "rl_iterations": arms["rl"]["iterations"],
              "before_outcomes": before_out.astype(int).tolist(),
              "minutes": minutes, "arms": arms, "total_minutes": (time.perf_counter() - t_all) / 60,
              "load_before": load0, "load_after": os.getloadavg(), "machine": machine(),
              "goal_met": goal_met(cfg.env, cfg.minutes, before, after, diff["mean"], diff["se"])}
    (out / "rl_improvement.json").write_text(json.dumps(result, indent=1))
    if len(cfg.task) > 1:  # a task solved (or never solved) from the start hides in the mean
        for t, r in per_task(cfg.task, cfg.eval_states, {"before": before_out.tolist(), **outcomes}).items():
            print(f"task {t}: held-out success before {r['before']:.3f}, " + ", ".join(
                f"{arm} {r[arm]:.3f}" for arm in ARMS), flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, label in (("rl", f"RL ({cfg.objective})"), ("sft", "continued SFT"), ("rft", "RFT")):
        c = arms[arm]["curve"]
        k = key if arm == "rl" else "None"
        xs, ys = [0.0] + [p["minutes"] for p in c], [before] + [p[k] for p in c]
        ns = [n] + [p.get("states", n) for p in c]
        ax.errorbar(xs, ys, yerr=[se(y, m) for y, m in zip(ys, ns)], marker="o", capsize=2, label=label)
    n_curve = len(curve_subset(cfg, held))
    states = f"{n} states" + (f", curve points {n_curve}" if n_curve < n else "")
    shared = ("arms side by side on 2 cores" if cfg.arm_schedule == "side_by_side" else
              "each arm on a core of its own")
    ax.set(xlabel=f"wall-clock minutes ({shared})", ylabel=f"held-out success ({states})",
           ylim=(0, 1), title=f"{cfg.env} task {cfg.task}, seed {cfg.seed}, start {before:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rl_improvement.png", dpi=100)
    print(f"total {result['total_minutes']:.1f} min; {out}/rl_improvement.json, .png", flush=True)
    print(f"before={before:.3f} after={after:.3f} sft={sft_rate:.3f} rft={rft_rate:.3f} w1={w1:.3f} "
          f"minutes={minutes:.1f}")
    return result


if __name__ == "__main__":
    main()
