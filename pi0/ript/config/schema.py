"""One typed config tree for RL training (stages 7-11): OmegaConf structured dataclasses, validated at load.

``TrainConfig`` has the sections ``algo`` (the RIPT settings: :class:`pi0.ript.trainer.RLConfig`, with its
``opt`` :class:`OptimizerConfig`), ``task`` (env / suite / task ids / checkpoint / init-state split), ``env`` (the
rollout :class:`pi0.rollout.config.RunnerConfig` + arena settings), ``distributed``, ``features``, ``baseline``
(continued SFT beside RL) and ``logging``.
:func:`load_config` merges a YAML file and ``key=value`` overrides onto the defaults and raises
:class:`pi0.errors.UserError` naming the key and what is allowed for an unknown key, a wrong type, an
out-of-range value, a task id the suite lacks or a missing checkpoint -- before any work starts. A stage script
that runs a subset of the job (stages 7 and 8) states its limits as :class:`StageRules`, checked the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pi0.errors import UserError, require_path
from pi0.models.flow_sde import SDE_KINDS, check_sde
from pi0.models.pi0 import TRAINABLE
from pi0.rollout.config import RunnerConfig
from pi0.ript.objectives import OBJECTIVES
from pi0.ript.trainer import PRECISIONS, RLConfig
from pi0.ript.update import LR_SCHEDULES

PRESET_DIR = Path(__file__).parent
ENVS = ("arena", "libero", "metaworld")
BACKENDS = ("auto", "nccl", "gloo")
COUNTERS = ("file", "store")


@dataclass
class TaskConfig:
    """What to train on and from which weights."""

    env: str = "arena"  # "arena" (built-in, CPU-cheap) | "libero" | "metaworld" (MT10; pi0/envs/metaworld_env.py)
    suite: str = "libero_spatial"  # LIBERO suite (env=libero)
    task_ids: list[int] = field(default_factory=lambda: [4])
    checkpoint: str = ""  # PI0Policy directory; "" = tiny warm start on scripted demos (arena, MetaWorld; cached
    # under runs/) / tiny random pi0 (LIBERO); openpi-PyTorch, RLinf and LeRobot pi0 / pi0.5 directories load too:
    tokenizer: str = ""  # for those: PaliGemma's sentencepiece model ("" = <checkpoint>/tokenizer.model)
    norm_stats: str = ""  # for those: their norm_stats.json when the directory has none
    openpi_config: str = ""  # for those: the openpi TrainConfig preset (a pi0.5 needs one, e.g. pi05_libero)
    train_states: int = 40  # training init states per task: 0..n-1
    eval_start: int = 40  # held-out init states eval_start..eval_start+eval_states-1
    eval_states: int = 10
    warm_start_demos: int = 10  # scripted-expert demos per task for the tiny warm start (arena, MetaWorld)
    warm_start_steps: int = 300  # most SFT steps of the warm start (0: start from the random tiny pi0)
    # > 0: a converged start: SFT until success on the validation init states
    # train_states..train_states+warm_start_val_states-1 has not improved for this many checks, every
    # warm_start_every steps, keeping the best weights (pi0.ript.warm_start.Plateau; reaching warm_start_steps
    # first is an error: the start would not be converged by its rule); 0 = warm_start_steps steps
    warm_start_patience: int = 0
    warm_start_every: int = 250
    warm_start_val_states: int = 50
    warm_start_smooth: int = 1  # the plateau's criterion: the mean of the last n validation checks (1: each check)
    # patience counts only once the criterion has been above 0: checks at 0 before the start first succeeds are not a
    # plateau (a start that never succeeds by warm_start_steps is an error)
    warm_start_patience_from_success: bool = True
    warm_start_threads: int = 0  # torch threads while the start trains alone (0: every core), then ``threads``
    warm_start_lr: float = 1e-3  # the start's SFT step size (AdamW, constant until the cooldown)
    # > 0: then this many SFT steps from the start's weights with the step size decayed linearly to 0
    # (pi0.ript.warm_start.cool_down), cached as <start>-cool<n>; 0: the plateau's weights as they are
    warm_start_cooldown: int = 0
    warm_start_minibatch: int = 32  # the start's SFT minibatch (windows per step)
    # processes the start's SFT runs in (with warm_start_patience > 0): gloo data parallel, one thread each, the
    # minibatch and the validation states split among them (pi0.ript.warm_start.sft_to_plateau_parallel)
    warm_start_procs: int = 1
    # the start's seed (its random init, the demos' noise, the SFT minibatches): another value trains an independent
    # start, cached under its own key (algo.seed seeds RL alone)
    warm_start_seed: int = 0


@dataclass
class EnvConfig:
    """The rollout runner and env construction."""

    # The runner's use_subprocess, schedule and group_size are set from ``features`` (see DERIVED); a YAML that sets
    # them is refused with the key to set instead. Under the RIPT-VLA layout num_envs defaults to num_groups x K.
    runner: RunnerConfig = field(default_factory=lambda: RunnerConfig(num_envs=8, use_subprocess=False))
    resolution: int = 64  # render size of the arena and MetaWorld cameras
    num_init_states: int = 200  # arena / MetaWorld init states per task


@dataclass
class FeatureFlags:
    """Switches of optional behaviour; each is tested (tests/test_train_config.py)."""

    # Step envs in subprocess workers instead of in-process; LIBERO needs it. (Sets env.runner.use_subprocess.)
    enable_parallel_envs: bool = False
    # RIPT-VLA runner layout: grouped schedule (the K members of a group advance together, one batched policy
    # call per group round), by default with num_envs = algo.num_groups x algo.group_size (every group at once;
    # pi0.rollout.ript_vla_runner_config); False: the greedy schedule. (Sets env.runner.schedule and group_size.)
    use_ript_vla_runner: bool = False
    # Smart sampling: dynamic sampling (drop all-equal groups, keep collecting) + the init-state history
    # (skip states whose last K rollouts all succeeded, re-probe after history_reprobe_after skips).
    # (Sets algo.dynamic_sampling.)
    enable_smart_sampling: bool = True
    history_reprobe_after: int = 3
    # Write logging.num_videos rollout videos (imageio mp4) of the last evaluation / collection.
    save_video: bool = False
    # Stop collection on every rank once the global number of kept groups reaches algo.num_groups x world size
    # (FileGlobalCounter / c10d store counter, see distributed.counter).
    enable_global_counter: bool = True
    # Save a resumable checkpoint (model + optimizer + scheduler + every rank's RNG + history + iteration).
    save_resume_state: bool = True


@dataclass
class BaselineConfig:
    """Continued SFT beside the RL run (``pi0.ript.sft_baseline``), from the same warm start and on its demos, for the
    same wall-clock: it trains only while RL trains, is snapshotted at RL's evaluations and scored on the same
    held-out states with the same per-episode noise (single process; the arena / MetaWorld warm start)."""

    sft: bool = False
    sft_lr: float = 1e-3
    warmup_steps: int = 50  # its fresh AdamW's linear lr warm-up (OptimizerConfig.warmup_steps)
    # "cosine": the lr decays to 0 over the shared budget (the fraction of RL's algo.iterations done), as
    # ``lr_schedule`` does for RL; "constant": baseline.sft_lr throughout
    sft_schedule: str = "constant"


@dataclass
class DistributedConfig:
    """torchrun settings (world size / rank come from torchrun's environment)."""

    backend: str = "auto"  # "auto" (nccl on GPU, gloo on CPU) | "nccl" | "gloo"
    counter: str = "file"  # global counter: "file" (shared filesystem) | "store" (c10d store, multi-node)
    timeout_s: float = 600.0  # collective timeout


@dataclass
class LoggingConfig:
    """Outputs under ``<out_dir>/<run_name>/``."""

    out_dir: str = "runs"
    run_name: str = "ript"
    save_every: int = 5  # iterations between checkpoints (the last one is always saved)
    num_videos: int = 2  # rollout videos written when features.save_video
    progress: bool = True  # tqdm bar (rank 0 only)
    plot: bool = True  # PNG plot of success against iteration


@dataclass
class TrainConfig:
    """The whole training config."""

    algo: RLConfig = field(default_factory=RLConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    features: FeatureFlags = field(default_factory=FeatureFlags)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    device: str = "cpu"  # "cpu" | "cuda" (each rank takes cuda:<LOCAL_RANK>)
    threads: int = 1  # torch CPU threads per process
    warmup_iterations: int = 0  # linear LR warm-up over this many iterations (LambdaLR, saved with checkpoints)
    lr_schedule: str = "constant"  # RL's lr over algo.iterations: constant | cosine (to 0 at the end), x the warm-up

    @property
    def run_dir(self) -> Path:
        """``<logging.out_dir>/<logging.run_name>``."""
        return Path(self.logging.out_dir) / self.logging.run_name


# key -> (predicate, what is allowed); checked after the types (OmegaConf) are.
_RANGES: dict[str, tuple[Any, str]] = {
    "algo.iterations": (lambda v: v >= 1, ">= 1"),
    "algo.num_groups": (lambda v: v >= 1, ">= 1"),
    "algo.group_size": (lambda v: v >= 2, ">= 2 (RLOO needs two rollouts per state)"),
    "algo.objective": (lambda v: v in OBJECTIVES, f"one of {OBJECTIVES}"),
    "algo.trainable": (lambda v: v in TRAINABLE, f"one of {TRAINABLE}"),
    "algo.precision": (lambda v: v in PRECISIONS, f"one of {PRECISIONS}"),
    "algo.noise_level": (lambda v: v > 0.0, "> 0 (Flow-SDE noise level a; 1.0 at sde_step 0, RLinf: 0.3-0.5)"),
    "algo.sde_step": (lambda v: v >= -2, ">= -2 (-1: a uniformly drawn step; -2: every step, the whole chain's ratio; "
                                         "k: always step k < policy num_steps)"),
    "algo.sde_kind": (lambda v: v in SDE_KINDS, f"one of {SDE_KINDS} (cps: algo.noise_level is its eta, <= 1)"),
    "algo.clip": (lambda v: 0.0 < v < 1.0, "in (0, 1)"),
    "algo.p_uncond": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "algo.demo_coef": (lambda v: v >= 0.0, ">= 0 (0: no demo anchor)"),
    "algo.cfg_guidance": (lambda v: v >= 0.0, ">= 0"),
    "algo.max_collect_attempts": (lambda v: v >= 1, ">= 1"),
    "algo.oversample": (lambda v: v >= 0.0, ">= 0 (0: sequential collection rounds; RLConfig.oversample)"),
    "algo.eval_every": (lambda v: v >= 0, ">= 0 (0 = never)"),
    "algo.eval_repeats": (lambda v: v >= 1, ">= 1"),
    "algo.opt.lr": (lambda v: v > 0.0, "> 0"),
    "algo.opt.value_lr": (lambda v: v > 0.0, "> 0 (the value head's lr, algo.value_baseline)"),
    "algo.opt.epochs": (lambda v: v >= 1, ">= 1"),
    "algo.opt.minibatch_size": (lambda v: v >= 1, ">= 1"),
    "algo.opt.grad_accum_steps": (lambda v: v >= 1, ">= 1"),
    "task.env": (lambda v: v in ENVS, f"one of {ENVS}"),
    "task.train_states": (lambda v: v >= 1, ">= 1"),
    "task.eval_states": (lambda v: v >= 0, ">= 0"),
    "task.warm_start_demos": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_steps": (lambda v: v >= 0, ">= 0"),
    "task.warm_start_patience": (lambda v: v >= 0, ">= 0 (0 = a fixed number of SFT steps)"),
    "task.warm_start_every": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_val_states": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_smooth": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_threads": (lambda v: v >= 0, ">= 0 (0: every core)"),
    "task.warm_start_lr": (lambda v: v > 0.0, "> 0"),
    "task.warm_start_cooldown": (lambda v: v >= 0, ">= 0"),
    "task.warm_start_minibatch": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_procs": (lambda v: v >= 1, ">= 1"),
    "task.warm_start_seed": (lambda v: v >= 0, ">= 0"),
    "env.resolution": (lambda v: v >= 16, ">= 16"),
    "baseline.sft_lr": (lambda v: v > 0.0, "> 0"),
    "baseline.warmup_steps": (lambda v: v >= 0, ">= 0"),
    "baseline.sft_schedule": (lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
    "features.history_reprobe_after": (lambda v: v >= 1, ">= 1"),
    "distributed.backend": (lambda v: v in BACKENDS, f"one of {BACKENDS}"),
    "distributed.counter": (lambda v: v in COUNTERS, f"one of {COUNTERS}"),
    "logging.save_every": (lambda v: v >= 1, ">= 1"),
    "logging.num_videos": (lambda v: v >= 0, ">= 0"),
    "threads": (lambda v: v >= 1, ">= 1"),
    "warmup_iterations": (lambda v: v >= 0, ">= 0"),
    "lr_schedule": (lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
    "device": (lambda v: v == "cpu" or v.startswith("cuda"), "'cpu' or 'cuda[:N]'"),
}


# Keys a config file or override may not set: each is derived from the one name given here (apply_features).
DERIVED: dict[str, str] = {
    "env.runner.use_subprocess": "features.enable_parallel_envs",
    "env.runner.schedule": "features.use_ript_vla_runner",
    "env.runner.group_size": "features.use_ript_vla_runner (the runner then takes algo.group_size)",
    "algo.dynamic_sampling": "features.enable_smart_sampling",
}


def _reject_derived(layer: Any, where: str) -> None:
    """UserError if ``layer`` (one YAML file or the overrides) sets a derived key, naming the key to set."""
    for key, instead in DERIVED.items():
        if OmegaConf.select(layer, key, default=None) is not None:
            raise UserError(f"{where} sets {key}, which is derived from {instead}; remove it and set that instead")


def check_ranges(cfg: TrainConfig) -> None:
    """The range / choice checks of ``_RANGES``, then the stochastic step's (UserError naming the first bad key)."""
    for key, (ok, allowed) in _RANGES.items():
        v = _get(cfg, key)
        if not ok(v):
            raise UserError(f"{key}={v!r} is out of range; allowed: {allowed}")
    try:  # cps takes its eta in (0, 1]; its last-step check needs the policy's num_steps (RIPTTrainer)
        check_sde(cfg.algo.sde_kind, cfg.algo.noise_level, None, 1)
    except ValueError as e:
        raise UserError(f"algo.noise_level / algo.sde_kind: {e}") from None


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_tasks(cfg: TrainConfig) -> None:
    """Task ids the env / suite has (and enough init states for the split)."""
    t = cfg.task
    if not t.task_ids:
        raise UserError("task.task_ids is empty; give at least one task id")
    if t.eval_states and t.eval_start < t.train_states:
        raise UserError(f"task.eval_start={t.eval_start} < task.train_states={t.train_states}: held-out init "
                        "states would overlap the training ones; set task.eval_start >= task.train_states")
    if t.warm_start_patience > 0 and t.eval_states and t.eval_start < t.train_states + t.warm_start_val_states:
        raise UserError(f"task.warm_start_patience > 0 validates on init states {t.train_states}.."
                        f"{t.train_states + t.warm_start_val_states - 1}, which overlap the held-out ones from "
                        f"task.eval_start={t.eval_start}; set task.eval_start >= task.train_states + "
                        "task.warm_start_val_states")
    if t.warm_start_minibatch % t.warm_start_procs:
        raise UserError(f"task.warm_start_minibatch={t.warm_start_minibatch} does not divide among "
                        f"task.warm_start_procs={t.warm_start_procs} processes; make it a multiple")
    if t.env == "metaworld":
        from pi0.envs.metaworld_env import MT10_TASKS
        bad = [i for i in t.task_ids if not 0 <= i < len(MT10_TASKS)]
        if bad:
            raise UserError(f"task.task_ids: unknown MetaWorld task id(s) {bad}; valid MT10 ids are "
                            f"0..{len(MT10_TASKS) - 1}")
    elif t.env == "arena":
        from pi0.envs.arena import TASKS
        bad = [i for i in t.task_ids if not 0 <= i < len(TASKS)]
        if bad:
            raise UserError(f"task.task_ids: unknown arena task id(s) {bad}; valid ids are 0..{len(TASKS) - 1}")
        need = max(t.train_states + (t.warm_start_val_states if t.warm_start_patience > 0 else 0),
                   t.eval_start + t.eval_states)
        if need > cfg.env.num_init_states:
            raise UserError(f"task: the init-state split needs {need} arena init states > env.num_init_states="
                            f"{cfg.env.num_init_states}; raise env.num_init_states or lower the split")
    else:
        from pi0.envs.conventions import LIBERO_SUITES
        if t.suite not in LIBERO_SUITES:
            raise UserError(f"task.suite={t.suite!r} is not a LIBERO suite; allowed: {', '.join(LIBERO_SUITES)}")
        try:
            from pi0.envs.libero_env import libero_task_info
            infos = libero_task_info(t.suite)
        except ImportError as err:
            raise UserError(f"task.env=libero needs the LIBERO simulator ({err}); pip install -e '.[libero]'") from None
        bad = [i for i in t.task_ids if not 0 <= i < len(infos)]
        if bad:
            raise UserError(f"task.task_ids: {t.suite} has no task id(s) {bad}; valid ids are 0..{len(infos) - 1}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range / choice checks, task ids and the checkpoint path (raises UserError naming the key)."""
    check_ranges(cfg)
    _check_tasks(cfg)
    uses = [(use, fix) for on, use, fix in (
        (cfg.baseline.sft, "baseline.sft=true (continued SFT)", "baseline.sft=false"),
        (cfg.algo.demo_coef > 0, f"algo.demo_coef={cfg.algo.demo_coef:g} (RL's demo anchor)", "algo.demo_coef=0"))
        if on]
    if uses and (cfg.task.checkpoint or cfg.task.env == "libero"):  # one error naming every fix (stage 11 has both)
        raise UserError(f"{' and '.join(u for u, _ in uses)} {'train' if len(uses) > 1 else 'trains'} on the tiny "
                        f"warm start's demos, and "
                        f"{'task.checkpoint' if cfg.task.checkpoint else 'task.env=libero'} has none "
                        f"(task.env=arena or metaworld, no task.checkpoint); set {' '.join(f for _, f in uses)}")
    if cfg.baseline.sft and not (cfg.algo.eval_every and cfg.task.eval_states):
        raise UserError("baseline.sft=true is scored at RL's held-out evaluations: set algo.eval_every >= 1 and "
                        "task.eval_states >= 1")
    if cfg.baseline.sft and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("baseline.sft=true runs continued SFT beside a single-process job; under torchrun set "
                        "baseline.sft=false")
    if cfg.task.checkpoint:
        from pi0.policies.loading import check_checkpoint

        t = cfg.task
        check_checkpoint(t.checkpoint, "task.checkpoint", tokenizer=t.tokenizer, norm_stats=t.norm_stats,
                         openpi_config=t.openpi_config)
    return cfg


@dataclass(frozen=True)
class StageRules:
    """What one stage script allows of the tree (stages 7 and 8 run a subset of the job), checked after
    :func:`load_config` and before any work: each ``fixed`` key must hold its value, and a ``single_process``
    stage refuses a torchrun launch (``WORLD_SIZE`` > 1). A violation is a :class:`UserError` naming the key."""

    script: str  # the stage script, for messages
    single_process: bool = False
    fixed: Mapping[str, tuple[Any, str]] = field(default_factory=dict)  # key -> (required value, why)

    def check(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` if it keeps to the rules, else UserError."""
        for key, (want, why) in self.fixed.items():
            v = _get(cfg, key)
            if v != want:
                raise UserError(f"{key}={v!r} is not allowed by {self.script}; allowed: {want!r} ({why})")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.single_process and world > 1:
            raise UserError(f"{self.script} is single-process but runs with WORLD_SIZE={world} (torchrun); launch "
                            "10_train_with_distributed.py or 11_train_ript_vla_style.py with torchrun instead")
        return cfg


def apply_features(cfg: TrainConfig, default_num_envs: bool = True) -> TrainConfig:
    """Set the derived runner / algo fields (``DERIVED``) from the feature flags (idempotent).

    Under the RIPT-VLA layout ``env.runner.num_envs`` defaults to algo.num_groups x algo.group_size (every group
    advances at once); ``default_num_envs=False`` (the config set num_envs) keeps the given count (groups then run
    in waves of num_envs // group_size).
    """
    f = cfg.features
    changes: dict[str, Any] = dict(use_subprocess=f.enable_parallel_envs, schedule="greedy", group_size=1)
    if f.use_ript_vla_runner:
        changes.update(schedule="grouped", group_size=cfg.algo.group_size)
        if default_num_envs:
            changes["num_envs"] = cfg.algo.num_groups * cfg.algo.group_size
    cfg.env.runner = cfg.env.runner.replace(**changes)
    cfg.algo.dynamic_sampling = f.enable_smart_sampling
    return cfg


def preset_path(name: str) -> Path:
    """Path of a bundled preset (``name`` with or without ``.yaml``)."""
    p = PRESET_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not p.is_file():
        raise UserError(f"no preset {name!r}; bundled presets: {', '.join(presets())}")
    return p


def presets() -> list[str]:
    """Names of the bundled YAML presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), check_paths: bool = True
                ) -> TrainConfig:
    """Defaults <- YAML ``path`` (a file or a bundled preset name) <- ``key=value`` overrides -> validated config."""
    base = OmegaConf.structured(TrainConfig)
    try:
        layers = [base]
        named: list[tuple[Any, str]] = []
        if path:
            p = Path(path)
            if not p.is_file():
                p = preset_path(str(path)) if "/" not in str(path) else require_path(p, "--config_path", "a YAML file")
            named.append((OmegaConf.load(p), f"config file {p}"))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise UserError(f"override {bad[0]!r} is not key=value (e.g. algo.iterations=3)")
        named.append((OmegaConf.from_dotlist(list(overrides)), "the command line"))
        layers += [layer for layer, _ in named]
        for layer, where in named:
            _reject_derived(layer, where)
        merged = OmegaConf.merge(*layers)
        num_envs_given = any(OmegaConf.select(layer, "env.runner.num_envs", default=None) is not None
                             for layer, _ in named)
        cfg: TrainConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        msg = str(err).splitlines()[0]
        if key and "not in" in msg:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            node = OmegaConf.select(base, parent) if parent else base
            msg += f"; allowed keys: {', '.join(node.keys())}"
        raise UserError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from None
    except ValueError as err:  # a dataclass __post_init__ (env.runner's RunnerConfig) rejected a value
        if isinstance(err, UserError):
            raise
        raise UserError(f"config env.runner: {err}") from None
    apply_features(cfg, default_num_envs=not num_envs_given)
    if check_paths:
        validate(cfg)
    else:
        check_ranges(cfg)
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, without the derived keys (so that ``load_config`` reads it back)."""
    node = OmegaConf.structured(cfg)
    for key in DERIVED:
        parent, leaf = key.rsplit(".", 1)
        container = OmegaConf.select(node, parent)
        with open_dict(container):
            del container[leaf]
    return OmegaConf.to_yaml(node)


def save_config(cfg: TrainConfig, path: str | Path) -> Path:
    """Write the resolved config (``config.yaml`` of a run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """Shallow dataclass replace (for tests)."""
    return dataclasses.replace(cfg, **changes)
