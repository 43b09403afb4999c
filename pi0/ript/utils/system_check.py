"""Pre-flight checks of a training setup (``quick_single_gpu_test.py``): each returns (ok, detail, fix)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pi0.ript.config.schema import TrainConfig

GB_PER_LIBERO_ENV = 2.0  # resident memory of one LIBERO env worker (MuJoCo + robosuite + renders), roughly


@dataclass
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def check_imports(cfg: TrainConfig) -> Check:
    """The Python packages the run needs."""
    mods = ["torch", "numpy", "safetensors", "sentencepiece", "omegaconf", "imageio", "tensorboard", "tqdm"]
    mods += ["libero", "robosuite", "mujoco"] if cfg.task.env == "libero" else []
    missing = []
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as err:  # noqa: BLE001 - a broken install raises anything
            missing.append(f"{m} ({type(err).__name__})")
    if missing:
        fix = "make install" + (" && pip install -e '.[libero]'" if cfg.task.env == "libero" else "")
        return Check("imports", False, "missing: " + ", ".join(missing), fix)
    return Check("imports", True, ", ".join(mods))


def check_rendering(cfg: TrainConfig) -> Check:
    """MuJoCo can open an offscreen GL context with MUJOCO_GL=egl or osmesa (tried in a subprocess)."""
    if cfg.task.env == "arena":
        return Check("rendering", True, "arena renders with numpy (no GL needed)")
    tried = []
    for backend in (os.environ.get("MUJOCO_GL", "egl"), "osmesa"):
        env = {**os.environ, "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend}
        code = "import mujoco; c = mujoco.GLContext(64, 64); c.make_current(); c.free()"
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return Check("rendering", True, f"MUJOCO_GL={backend} works"
                         + ("" if backend == os.environ.get("MUJOCO_GL") else f" (export MUJOCO_GL={backend})"))
        tried.append(f"{backend}: {(r.stderr.strip().splitlines() or ['failed'])[-1][:80]}")
    return Check("rendering", False, "; ".join(tried),
                 "apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri libosmesa6 (make install does it); "
                 "export MUJOCO_GL=egl (GPU) or MUJOCO_GL=osmesa (CPU)")


def check_libero_assets(cfg: TrainConfig) -> Check:
    """The suite's tasks and enough init states for the configured split."""
    if cfg.task.env == "arena":
        return Check("env assets", True, "arena is built in")
    try:
        from pi0.envs.libero_env import libero_task_info
        infos = {t: n for t, _, n in libero_task_info(cfg.task.suite)}
    except Exception as err:  # noqa: BLE001
        return Check("LIBERO assets", False, f"{type(err).__name__}: {err}",
                     "pip install -e '.[libero]' (bundles the BDDL files, assets and init states)")
    need = max(cfg.task.train_states, cfg.task.eval_start + cfg.task.eval_states)
    short = {t: infos.get(t, 0) for t in cfg.task.task_ids if infos.get(t, 0) < need}
    if short:
        return Check("LIBERO assets", False, f"{cfg.task.suite}: tasks {short} have fewer than {need} init states",
                     "lower task.train_states / task.eval_start / task.eval_states")
    return Check("LIBERO assets", True, f"{cfg.task.suite}: {len(cfg.task.task_ids)} task(s), >= {need} init states each")


def check_checkpoint(cfg: TrainConfig) -> Check:
    """model.safetensors + config.json + norm_stats.json + tokenizer.model present and loadable."""
    ck = cfg.task.checkpoint
    if not ck:
        return Check("checkpoint", True, "none configured: the tiny warm start / tiny random pi0 is used")
    from pi0.errors import UserError
    from pi0.policies.loading import check_checkpoint

    t = cfg.task
    try:
        what = check_checkpoint(ck, "task.checkpoint", tokenizer=t.tokenizer, norm_stats=t.norm_stats,
                                openpi_config=t.openpi_config)
    except UserError as err:
        return Check("checkpoint", False, str(err), "convert weights with convert_pi0_to_hf_lerobot.py (it writes all "
                     "four files) or pass what the message names")
    try:
        from pi0.policies.pi0 import PI0Policy
        t0 = time.perf_counter()
        PI0Policy.from_pretrained(ck, tokenizer=t.tokenizer or None, norm_stats=t.norm_stats or None,
                                  openpi_config=t.openpi_config or None)
        return Check("checkpoint", True, f"{what} loads ({time.perf_counter() - t0:.1f}s)")
    except Exception as err:  # noqa: BLE001
        return Check("checkpoint", False, f"{ck}: {type(err).__name__}: {err}", "re-run the conversion")


def check_devices(cfg: TrainConfig) -> Check:
    """The device exists; free memory vs ~2 GB per LIBERO env (host RAM) and the model (GPU)."""
    import psutil
    import torch

    envs = cfg.env.runner.num_envs
    need_gb = envs * GB_PER_LIBERO_ENV if cfg.task.env == "libero" else 0.2 * envs
    free_gb = psutil.virtual_memory().available / 2**30
    parts = [f"host RAM {free_gb:.1f} GB free for {envs} envs (~{need_gb:.1f} GB)"]
    ok, fix = free_gb >= need_gb, "lower env.runner.num_envs (or algo.num_groups x algo.group_size)"
    if cfg.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return Check("devices", False, "device=cuda but torch sees no GPU",
                         "set device=cpu, or install a CUDA build of torch and check nvidia-smi")
        free, total = torch.cuda.mem_get_info()
        parts.append(f"{torch.cuda.device_count()} GPU(s), {free / 2**30:.1f}/{total / 2**30:.1f} GB free")
        if free / 2**30 < 8:
            ok, fix = False, "free GPU memory (< 8 GB; pi0 training needs more) or use a bigger GPU"
    return Check("devices", ok, "; ".join(parts), "" if ok else fix)


def check_rollout_and_update(cfg: TrainConfig) -> Check:
    """One short group of rollouts and one update through the real training code."""
    from pi0.ript.utils.dist_utils import DistInfo
    from pi0.ript.utils.train_loop import build_runner, build_trainer, initial_policy

    small = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, num_groups=1, group_size=2,
                                                              dynamic_sampling=False, eval_every=0,
                                                              max_collect_attempts=1),
                                env=dataclasses.replace(cfg.env, runner=cfg.env.runner.replace(
                                    num_envs=2, max_steps=10, schedule="greedy")),
                                task=dataclasses.replace(cfg.task, eval_states=0, warm_start_patience=0,
                                                         warm_start_steps=min(cfg.task.warm_start_steps, 5)))
    t0 = time.perf_counter()
    try:
        info = DistInfo(device=cfg.device if cfg.device == "cpu" else "cuda:0")
        policy = initial_policy(small, info)
        with build_runner(small) as runner:
            st = build_trainer(small, info, policy, runner, small.run_dir).step()
    except Exception as err:  # noqa: BLE001
        return Check("rollout+update", False, f"{type(err).__name__}: {err}",
                     "fix the failures above first; rerun with the traceback: python -X dev quick_single_gpu_test.py")
    return Check("rollout+update", st["train/steps"] >= 1,
                 f"2 rollouts of 10 steps + {int(st['train/steps'])} update step(s) in {time.perf_counter() - t0:.1f}s",
                 "" if st["train/steps"] >= 1 else "the update produced no step (non-finite loss?)")


CHECKS: list[Callable[[TrainConfig], Check]] = [check_imports, check_rendering, check_libero_assets,
                                                check_checkpoint, check_devices, check_rollout_and_update]


def run_checks(cfg: TrainConfig, skip_rollout: bool = False) -> list[Check]:
    """Every check in order (the rollout check is skipped when an earlier one failed or when asked)."""
    out: list[Check] = []
    for fn in CHECKS:
        if fn is check_rollout_and_update and (skip_rollout or not all(c.ok for c in out)):
            out.append(Check("rollout+update", False, "skipped", "fix the failures above first") if not skip_rollout
                       else Check("rollout+update", True, "skipped (--skip_rollout)"))
            continue
        out.append(fn(cfg))
    return out
