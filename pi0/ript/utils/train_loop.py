"""The config-driven RIPT training job of stages 7-11 (single process or torchrun) around ``RIPTTrainer``.

Each rank: its shard of the training init states (seed offset by rank), its own runner; collection stops early
through the global counter once all ranks together kept ``algo.num_groups x world`` groups; the update is
``pi0.ript.update.PolicyUpdate`` (same number of collectives and steps on every rank, masked batches where a rank
has no data); scalars are all-reduced and logged on rank 0 (tqdm, TensorBoard, curve JSON/PNG), which also
writes videos and checkpoints. With smart sampling on, each rank writes its init-state history as JSON every
iteration (``history.json`` on rank 0). ``resume=True`` continues from ``<run>/checkpoints/latest``. Stage scripts
differ only in their default preset and :class:`pi0.ript.config.StageRules` (see :func:`cli_main`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pi0.envs import make_env_spec
from pi0.errors import UserError
from pi0.policies.pi0 import PI0Policy
from pi0.rollout import RolloutRunner
from pi0.ript.algos.rl_optimizers.file_counter import FileGlobalCounter
from pi0.ript.algos.rl_optimizers.store_counter import StoreGlobalCounter
from pi0.ript.checkpoint import latest_checkpoint, load_train_state, save_checkpoint
from pi0.ript.config.schema import StageRules, TaskConfig, TrainConfig, save_config
from pi0.ript.init_states import InitStateHistory, InitStateSampler, split_states
from pi0.ript.trainer import RIPTTrainer
from pi0.ript.update import OptimizerConfig, lr_scale_at
from pi0.ript.utils.dist_utils import (DistInfo, DistributedStatsSynchronizer, barrier, cleanup_distributed,
                                       setup_distributed, shard_tasks_across_gpus)
from pi0.ript.utils.fsdp import gathered, save_policy
from pi0.utils.machine import machine


def seed_everything(seed: int) -> None:
    """Python, numpy and torch global seeds."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def initial_policy(cfg: TrainConfig, info: DistInfo) -> PI0Policy:
    """task.checkpoint, or the tiny arena warm start cached under ``<out_dir>/cache`` (rank 0 computes it first):
    SFT on the first ``task.warm_start_demos`` states' scripted-expert demos, until validation success plateaus
    (``task.warm_start_patience`` > 0) or for ``task.warm_start_steps``."""
    t = cfg.task
    if t.checkpoint:
        return PI0Policy.from_pretrained(t.checkpoint, device=info.device, tokenizer=t.tokenizer or None,
                                         norm_stats=t.norm_stats or None, openpi_config=t.openpi_config or None)
    if t.env == "libero":
        from pi0.policies.presets import tiny_policy
        return tiny_policy().to(info.device)
    policy = None
    for turn in (True, False):  # rank 0 computes + caches, then the others load the cache
        if info.is_main == turn:
            policy, _ = tiny_warm_start(cfg)
        barrier(info)
    return policy.to(info.device)


def start_val_states(t: TaskConfig) -> list[tuple[int, int]]:
    """The start's validation init states: train_states..train_states+warm_start_val_states-1 of each task."""
    return [(tid, i) for tid in t.task_ids for i in range(t.train_states, t.train_states + t.warm_start_val_states)]


def start_optimizer(t: TaskConfig) -> OptimizerConfig:
    """The start's SFT settings (its plateau phase and its cooldown)."""
    return OptimizerConfig(lr=t.warm_start_lr, minibatch_size=t.warm_start_minibatch)


def start_threads(t: TaskConfig) -> int:
    """Torch threads while the start trains alone (other ranks wait): warm_start_threads, else every core."""
    return t.warm_start_threads or os.cpu_count() or 1


def rl_lr_scale(cfg: TrainConfig, i: int) -> float:
    """RL's lr multiplier in its iteration ``i`` (0-based): the linear warm-up over ``warmup_iterations`` times
    ``lr_schedule`` at ``i / algo.iterations`` of the budget."""
    warm = cfg.warmup_iterations
    return (min(1.0, (i + 1) / warm) if warm else 1.0) * lr_scale_at(cfg.lr_schedule, i / cfg.algo.iterations)


def tiny_warm_start(cfg: TrainConfig) -> tuple[PI0Policy, list]:
    """The tiny arena / MetaWorld warm start of ``cfg.task`` (cached under ``<out_dir>/cache``) and its demo windows
    (the RL job's start, and the data of the continued-SFT baseline)."""
    from pi0.ript.warm_start import Plateau, TinyArenaConfig, cached_warm_start

    t = cfg.task
    tiny = TinyArenaConfig(seed=t.warm_start_seed,  # MT10's prompts are longer than the arena's
                           max_token_len=32 if t.env == "metaworld" else TinyArenaConfig.max_token_len)
    demos = [(tid, i) for tid in t.task_ids for i in range(t.warm_start_demos)]
    stop = None
    if t.warm_start_patience > 0:
        stop = Plateau(start_val_states(t), every=t.warm_start_every, patience=t.warm_start_patience,
                       smooth=t.warm_start_smooth, patience_from_success=t.warm_start_patience_from_success,
                       require_convergence=True)  # a start that reaches warm_start_steps first is an error
    threads = torch.get_num_threads()
    torch.set_num_threads(start_threads(t))
    try:
        policy, windows, _ = cached_warm_start(tiny, demos, t.warm_start_steps, start_optimizer(t),
                                               cache_dir=Path(cfg.logging.out_dir) / "cache",
                                               resolution=cfg.env.resolution, stop=stop, env=t.env,
                                               procs=t.warm_start_procs, cooldown=t.warm_start_cooldown)
    finally:
        torch.set_num_threads(threads)
    return policy, windows


def build_runner(cfg: TrainConfig, record_video: bool = False) -> RolloutRunner:
    """The runner the config describes (arena, MetaWorld or LIBERO env spec + ``env.runner``)."""
    rc = cfg.env.runner.replace(record_video=record_video) if record_video else cfg.env.runner
    os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering (as the Makefile exports) for the MuJoCo envs
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    if cfg.task.env in ("arena", "metaworld"):
        spec = make_env_spec(cfg.task.env, resolution=cfg.env.resolution, num_init_states=cfg.env.num_init_states)
    else:
        spec = make_env_spec("libero", cfg.task.suite, cfg.task.task_ids[0])
    return RolloutRunner(spec, None, rc)


def make_counter(cfg: TrainConfig, info: DistInfo, run_dir: Path, it: int) -> Any:
    """The per-iteration global counter (None when single-process or disabled)."""
    if not (info.enabled and cfg.features.enable_global_counter):
        return None
    if cfg.distributed.counter == "store":
        return StoreGlobalCounter(dist.distributed_c10d._get_default_store(), key=f"kept_groups_{it}")
    return FileGlobalCounter(run_dir / "counters" / f"iter_{it:05d}")


def build_trainer(cfg: TrainConfig, info: DistInfo, policy: PI0Policy, runner: RolloutRunner,
                  run_dir: Path) -> RIPTTrainer:
    """The trainer over this rank's shard of the training states, averaging its update over ranks and counting
    kept groups globally (``features.enable_global_counter``)."""
    t = cfg.task
    train, held_out = split_states(t.task_ids, t.train_states, t.eval_start, t.eval_states)
    shard = shard_tasks_across_gpus(train, info.rank, info.world_size)
    eval_shard = held_out[info.rank::info.world_size] if len(held_out) >= info.world_size else held_out
    seed = cfg.algo.seed + 1000 * info.rank
    algo = dataclasses.replace(cfg.algo, seed=seed)
    history = InitStateHistory(cfg.features.history_reprobe_after) if cfg.features.enable_smart_sampling else None
    demos = tiny_warm_start(cfg)[1] if algo.demo_coef > 0 else ()  # the cached start's demo windows (algo.demo_coef)
    return RIPTTrainer(policy, runner, InitStateSampler(shard, seed), algo, eval_shard, history=history, info=info,
                       counter=lambda it: make_counter(cfg, info, run_dir, it), demos=demos)


def global_stats(st: dict[str, float], trainer: RIPTTrainer, sync: DistributedStatsSynchronizer) -> dict[str, float]:
    """All-reduced iteration scalars (same collectives on every rank)."""
    col = trainer.last_collection
    k = trainer.cfg.group_size
    n_eval = len(trainer.eval_states) * trainer.cfg.eval_repeats if "eval/success_rate" in st else 0
    s = sync.sum({"succ": col.success_rate * col.num_groups * k, "rollouts": col.num_groups * k,
                  "kept": len(col.groups), "groups": col.num_groups, "windows": st["train/windows"],
                  "eval_succ": st.get("eval/success_rate", 0.0) * n_eval, "eval_n": n_eval,
                  "positives": st["train/frac_positive"] * st["train/windows"],
                  "skipped_states": st["rollout/skipped_states"]})
    m = sync.max({"rollout_s": st["time/rollout_s"], "update_s": st["time/update_s"]})
    out = {"success_rate": s["succ"] / s["rollouts"] if s["rollouts"] else 0.0, "rollouts": s["rollouts"],
           "frac_groups_kept": s["kept"] / s["groups"] if s["groups"] else 0.0, "kept_groups": s["kept"],
           "windows": s["windows"], "frac_positive": s["positives"] / s["windows"] if s["windows"] else 0.0,
           "skipped_states": s["skipped_states"], "rollout_s": m["rollout_s"], "update_s": m["update_s"],
           "steps": st["train/steps"], "skipped_steps": st["train/skipped_steps"]}
    if s["eval_n"]:
        out["eval_success_rate"] = s["eval_succ"] / s["eval_n"]
    for key in ("train/loss", "train/loss_cond", "train/loss_uncond", "train/clip_frac", "train/ratio_mean",
                "train/approx_kl", "train/demo_loss"):
        if key in st:  # this rank's minibatch means
            out[key.split("/")[1]] = st[key]
    return out


def baseline_summary(trainer: RIPTTrainer, curve: list[dict[str, float]], marks: list[dict[str, Any]],
                     rl_final: np.ndarray | None, sft_log: dict, run_dir: Path,
                     before: np.ndarray | None = None) -> dict[str, Any]:
    """Score the continued-SFT snapshots beside RL's evaluations -> summary.json's fields (before, rl, sft at the
    last mark, the paired RL − SFT difference, and with the start's outcomes ``before`` the paired RL − start and
    SFT − start, both curves against the arms' shared training minutes)."""
    from pi0.evaluation.paired import paired_difference

    sft_curve, sft_final = [], None
    for m in marks:
        sft_final = trainer.evaluate_outcomes(PI0Policy.from_pretrained(m["snapshot"]))
        sft_curve.append({"iteration": m["iteration"], "minutes": m["minutes"],
                          "eval_success_rate": float(sft_final.mean())})
    start = next((c["eval_success_rate"] for c in curve if c.get("iteration") == 0.0), None)
    rl_curve = [{"iteration": c["iteration"], "minutes": c["minutes"], "eval_success_rate": c["eval_success_rate"]}
                for c in curve if "minutes" in c and "eval_success_rate" in c]
    (run_dir / "sft_curve.json").write_text(json.dumps(sft_curve, indent=1))
    out: dict[str, Any] = {"before": start, "rl": None, "sft": None, "train_minutes": marks[-1]["minutes"] if marks
                           else 0.0, "held_out_episodes": 0, "rl_curve": rl_curve, "sft_curve": sft_curve,
                           "sft_steps": sft_log.get("steps"), "rl_iterations": trainer.iteration}
    if rl_final is not None and sft_final is not None:
        mean, se = paired_difference(rl_final, sft_final)
        out.update(rl=float(rl_final.mean()), sft=float(sft_final.mean()), held_out_episodes=len(rl_final),
                   rl_minus_sft={"mean": mean, "se": se})
        if before is not None and before.shape == rl_final.shape:  # (a resumed run has no start outcomes)
            for name, final in (("rl_minus_before", rl_final), ("sft_minus_before", sft_final)):
                mean, se = paired_difference(final, before)
                out[name] = {"mean": mean, "se": se}
    return out


def plot_curve(curve: list[dict[str, float]], path: Path, summary: dict[str, Any] | None = None) -> Path:
    """PNG of rollout / held-out success against iteration; with a continued-SFT baseline (``summary``), held-out
    success of RL and SFT with binomial error bars against the minutes they trained side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pi0.evaluation.paired import rate_se

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if summary is not None:
        n = summary["held_out_episodes"]
        for name, key, fmt in (("RL (LOOP)", "rl_curve", "o-"), ("continued SFT", "sft_curve", "s-")):
            pts = summary[key]
            xs = [0.0] + [p["minutes"] for p in pts]
            ys = [summary["before"]] + [p["eval_success_rate"] for p in pts]
            ax.errorbar(xs, ys, yerr=[rate_se(y, n) for y in ys], fmt=fmt, capsize=2, label=name)
        ax.set(xlabel="training minutes (RL and SFT side by side)", ylabel=f"held-out success ({n} episodes)",
               ylim=(-0.05, 1.05))
    else:
        roll = [c for c in curve if "success_rate" in c]
        ax.plot([c["iteration"] for c in roll], [c["success_rate"] for c in roll], "o-", label="rollout success")
        if any("eval_success_rate" in c for c in curve):
            ax.plot([c["iteration"] for c in curve if "eval_success_rate" in c],
                    [c["eval_success_rate"] for c in curve if "eval_success_rate" in c], "s-",
                    label="held-out success")
        ax.set(xlabel="iteration", ylabel="success", ylim=(-0.05, 1.05))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_videos(cfg: TrainConfig, policy: PI0Policy, trainer: RIPTTrainer, out: Path) -> list[Path]:
    """Roll out ``logging.num_videos`` held-out (or training) states with frames and write mp4s (rank 0)."""
    from pi0.policies.libero import Pi0ChunkPolicy
    from pi0.utils.video import write_video

    states = (trainer.eval_states or trainer.rollouts.sampler.pairs)[: cfg.logging.num_videos]
    with build_runner(cfg, record_video=True) as runner:
        eps = runner.run(states, group_size=1, policy=Pi0ChunkPolicy(policy, torch.Generator().manual_seed(0)))
    paths = []
    for (t, i), ep in zip(states, eps):
        if ep.frames:
            tag = "success" if ep.success else "failure"
            paths.append(write_video(out / f"task{t}_init{i}_{tag}.mp4", ep.frames, fps=10))
    return paths


def history_path(run_dir: Path, info: DistInfo) -> Path:
    """Where this rank writes its init-state history JSON: ``history.json`` (rank 0), ``history_rank<r>.json``."""
    return run_dir / ("history.json" if info.is_main else f"history_rank{info.rank}.json")


def train(cfg: TrainConfig, resume: bool = False) -> list[dict[str, float]]:
    """Run the job the config describes; returns the (global) per-iteration curve."""
    info = setup_distributed(cfg.distributed.backend, cfg.device, cfg.distributed.timeout_s)
    try:
        return _train(cfg, info, resume)
    finally:
        cleanup_distributed()


def _train(cfg: TrainConfig, info: DistInfo, resume: bool) -> list[dict[str, float]]:
    torch.set_num_threads(cfg.threads)
    if cfg.algo.fsdp and not info.enabled:
        raise UserError("algo.fsdp=true shards the model over torchrun ranks, but this is one process: launch with "
                        "torchrun --nproc_per_node N (N >= 2), or set algo.fsdp=false")
    run_dir = cfg.run_dir
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise UserError(f"--resume: no complete checkpoint under {run_dir}/checkpoints; run without --resume first")
    if resume and cfg.baseline.sft:
        raise UserError("--resume with baseline.sft=true: the continued-SFT baseline cannot resume (it would restart "
                        "from the warm start); resume with baseline.sft=false")
    t_job = time.perf_counter()
    seed_everything(cfg.algo.seed + 1000 * info.rank)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
    policy = PI0Policy.from_pretrained(ckpt, device=info.device) if ckpt else initial_policy(cfg, info)
    curve_path = run_dir / "curve.json"
    with build_runner(cfg) as runner:
        trainer = build_trainer(cfg, info, policy, runner, run_dir)
        sched = torch.optim.lr_scheduler.LambdaLR(trainer.update.optimizer, lambda i: rl_lr_scale(cfg, i))
        if ckpt:
            load_train_state(ckpt, trainer, sched, info)
        sync = DistributedStatsSynchronizer(info)
        writer = None
        if info.is_main:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(str(run_dir / "tb"))
        curve = [c for c in trainer.curve if "rollouts" in c or c.get("iteration") == 0.0]
        before: np.ndarray | None = None  # the start's per-episode held-out outcomes (this rank's)
        if not ckpt and trainer.cfg.eval_every and cfg.task.eval_states:  # the starting point of the curve
            before = trainer.evaluate_outcomes()
            ev, n = sync.weighted_mean(float(np.mean(before)) if len(before) else 0.0,
                                       len(trainer.eval_states) * trainer.cfg.eval_repeats)
            curve = [{"iteration": 0.0, "eval_success_rate": ev}]
            if info.is_main:
                print(f"iter 0: held-out success {ev:.2f} ({int(n)} episodes, before RL)", flush=True)
        trainer.curve = curve
        every = cfg.algo.eval_every
        base = None
        if cfg.baseline.sft and info.is_main:  # continued SFT beside RL (pi0.ript.sft_baseline); the loop evaluates
            from pi0.ript.sft_baseline import SFTBaseline
            trainer.cfg = dataclasses.replace(trainer.cfg, eval_every=0)
            base = SFTBaseline(run_dir)
        marks: list[dict[str, Any]] = []  # RL's evaluations beside the baseline: iteration, minutes, SFT snapshot
        rl_final: np.ndarray | None = None
        train_s, t_mark = 0.0, time.perf_counter()
        bar = None
        if info.is_main and cfg.logging.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.algo.iterations, initial=trainer.iteration, desc=f"RIPT-{cfg.algo.objective}", dynamic_ncols=True)
        while trainer.iteration < cfg.algo.iterations:
            it = trainer.iteration + 1
            lr = sched.get_last_lr()[0]  # this iteration's
            st = trainer.step()  # collect, advantages, windows, update, evaluate (pi0.ript.trainer)
            if base is not None:
                base.progress(it / cfg.algo.iterations)  # the shared budget's fraction, for baseline.sft_schedule
            if base is not None and every and (it % every == 0 or it == cfg.algo.iterations):
                train_s += time.perf_counter() - t_mark  # both arms trained this long since the last mark
                snap = base.pause(len(marks))
                rl_final = trainer.evaluate_outcomes()
                st["eval/success_rate"] = float(rl_final.mean())
                marks.append({"iteration": float(it), "minutes": train_s / 60, "snapshot": snap})
                if it < cfg.algo.iterations:  # after the last mark neither arm trains
                    base.resume(len(marks) - 1)
                t_mark = time.perf_counter()
            if trainer.rollouts.history is not None:
                trainer.rollouts.history.save(history_path(run_dir, info))
            with warnings.catch_warnings():  # no optimizer step happened when every group was filtered
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
            g = global_stats(st, trainer, sync)
            g["iteration"] = float(it)
            g["lr"] = lr
            if marks and marks[-1]["iteration"] == it:
                g["minutes"] = marks[-1]["minutes"]
            trainer.curve = curve = [c for c in curve if c["iteration"] < it] + [g]
            if info.is_main and cfg.features.enable_global_counter and cfg.distributed.counter == "file":
                FileGlobalCounter(run_dir / "counters" / f"iter_{it:05d}").cleanup()  # every rank is past collection
            if info.is_main:
                for k, v in g.items():
                    if k != "iteration":
                        writer.add_scalar(k, v, it)
                held = f"{g['eval_success_rate']:.2f}" if "eval_success_rate" in g else "-"
                msg = (f"iter {it}: success {g['success_rate']:.2f} ({int(g['rollouts'])} rollouts), kept groups "
                       f"{int(g['kept_groups'])} ({g['frac_groups_kept']:.2f}), positives {g['frac_positive']:.2f}, "
                       f"held-out {held}, steps {int(g['steps'])}"
                       + (f" ({int(g['skipped_steps'])} non-finite skipped)" if g["skipped_steps"] else "")
                       + (f", solved states skipped {int(g['skipped_states'])}" if g["skipped_states"] else "")
                       + (f", loss cond {g['loss_cond']:.4f}" if "loss_cond" in g else "")
                       + (f", loss uncond {g['loss_uncond']:.4f}" if "loss_uncond" in g else "")
                       + f", rollout {g['rollout_s']:.1f}s update {g['update_s']:.1f}s")
                (bar.write if bar else print)(msg)
                if bar:
                    bar.update(1)
                curve_path.parent.mkdir(parents=True, exist_ok=True)
                curve_path.write_text(json.dumps(curve, indent=1))
            if cfg.features.save_resume_state and (it % cfg.logging.save_every == 0 or it == cfg.algo.iterations):
                save_checkpoint(run_dir, trainer, sched, info)
        if bar:
            bar.close()
        summary = None
        if base is not None:
            sft_log = base.close()
            summary = baseline_summary(trainer, curve, marks, rl_final, sft_log, run_dir, before)
            for pt in summary["sft_curve"]:
                writer.add_scalar("baseline_sft/eval_success_rate", pt["eval_success_rate"], int(pt["iteration"]))
        save_policy(policy, run_dir / "final", info)  # every rank: gathers FSDP2 shards, rank 0 writes
        with gathered(policy.model):  # FSDP2: every rank gathers, rank 0 records the videos
            if info.is_main and cfg.features.save_video and cfg.logging.num_videos:
                write_videos(cfg, policy, trainer, run_dir / "videos")
        if info.is_main:
            if cfg.logging.plot and curve:
                plot_curve(curve, run_dir / "success.png", summary)
            if summary is not None:
                summary["minutes"] = (time.perf_counter() - t_job) / 60  # minutes are this machine's
                summary["machine"] = machine()
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
                print(f"held-out success: before {summary['before']:.2f}, RL {summary['rl']:.2f}, continued SFT "
                      f"{summary['sft']:.2f} after {summary['train_minutes']:.1f} min side by side; RL - SFT "
                      f"{summary['rl_minus_sft']['mean']:+.2f} +- {summary['rl_minus_sft']['se']:.2f}"
                      + (f", RL - start {summary['rl_minus_before']['mean']:+.2f} +- "
                         f"{summary['rl_minus_before']['se']:.2f}" if "rl_minus_before" in summary else "")
                      + f" (paired, {summary['held_out_episodes']} episodes); job {summary['minutes']:.1f} min",
                      flush=True)
            writer.close()
            print(f"run dir {run_dir}: config.yaml, curve.json, tb/, final/"
                  + (", summary.json, sft_baseline/" if summary is not None else "")
                  + (", history.json" if trainer.rollouts.history is not None else "")
                  + (", success.png" if cfg.logging.plot else "") + (", videos/" if cfg.features.save_video else "")
                  + (", checkpoints/" if cfg.features.save_resume_state else ""), flush=True)
        barrier(info)
    return curve


def cli_main(argv: list[str] | None, default_preset: str, description: str | None = None,
             rules: StageRules | None = None) -> list[dict[str, float]]:
    """``--config_path <yaml|preset> [--resume] [key=value ...]`` -> validated config (+ the stage's ``rules``)
    -> :func:`train`. Every stage script 7-11 is this call with its own default preset (and rules)."""
    import argparse

    from pi0.ript.config.schema import load_config

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", default=default_preset, help="YAML file or bundled preset name")
    p.add_argument("--resume", action="store_true", help="continue from <run>/checkpoints/latest")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.iterations=3")
    args = p.parse_args(argv)
    cfg = load_config(args.config_path, args.overrides)
    if rules is not None:
        rules.check(cfg)
    return train(cfg, resume=args.resume)
