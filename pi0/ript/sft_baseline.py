"""Continued SFT beside an RL run, for the same wall-clock (``baseline.sft``): the comparison ``make run`` plots.

The RL job (``pi0.ript.utils.train_loop``) starts this module as a subprocess on its run directory, and both train
from the same cached warm start, SFT on its demos with a fresh AdamW (``baseline.sft_lr``, warmed up over
``baseline.warmup_steps``). They meet at each of RL's evaluations through files under ``<run>/sft_baseline/``:

1. RL writes ``mark_<k>`` and waits;
2. SFT saves its weights as ``snap_<k>/``, writes ``saved_<k>`` and waits;
3. RL evaluates itself, then writes ``go_<k>``; both train on.

After each of its iterations RL writes ``progress`` (the fraction of ``algo.iterations`` done), from which
``baseline.sft_schedule=cosine`` sets the lr over the same budget as RL's ``lr_schedule``.

So the two train only in the same wall-clock windows (neither trains while RL evaluates), each SFT snapshot is the
baseline at the same training time as the RL evaluation it sits beside, and RL scores the snapshots afterwards on
the same held-out states with the same per-episode noise (paired). ``stop`` ends the process.

    python -m pi0.ript.sft_baseline runs/stage11_ript_vla    # started by the RL job, not by hand
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pi0.policies.pi0 import PI0Policy
    from pi0.ript.config.schema import TrainConfig
    from pi0.ript.update import PolicyUpdate

POLL_S = 0.02  # seconds between checks for the other side's file
DIRNAME = "sft_baseline"


class SFTBaseline:
    """The RL side: starts the SFT process and meets it at each evaluation (module docstring)."""

    def __init__(self, run_dir: Path, timeout_s: float = 1800.0):
        self.dir = Path(run_dir) / DIRNAME
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "pi0.ript.sft_baseline", str(run_dir)])
        self._wait("ready")  # it loaded the start: from here both train

    def _wait(self, name: str) -> None:
        t0 = time.perf_counter()
        while not (self.dir / name).exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the continued-SFT baseline process exited with code {self.proc.returncode} "
                                   f"before writing {name}; see its output above")
            if time.perf_counter() - t0 > self.timeout_s:
                self.close()
                raise RuntimeError(f"the continued-SFT baseline did not write {name} in {self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    def pause(self, k: int) -> Path:
        """Stop SFT at RL's evaluation ``k`` -> the directory of its weights at that moment."""
        (self.dir / f"mark_{k}").touch()
        self._wait(f"saved_{k}")
        return self.dir / f"snap_{k}"

    def progress(self, frac: float) -> None:
        """Tell SFT how much of the shared budget has passed (written atomically)."""
        tmp = self.dir / "progress.tmp"
        tmp.write_text(repr(float(frac)))
        tmp.replace(self.dir / "progress")

    def resume(self, k: int) -> None:
        """Let SFT train on after RL's evaluation ``k``."""
        (self.dir / f"go_{k}").touch()

    def close(self) -> dict:
        """End the SFT process -> its log (optimizer steps at each snapshot)."""
        (self.dir / "stop").touch()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        log = self.dir / "log.json"
        return json.loads(log.read_text()) if log.is_file() else {}


def baseline_update(cfg: TrainConfig, policy: PI0Policy) -> PolicyUpdate:
    """The arm's optimizer over ``policy``: a fresh AdamW at ``baseline.sft_lr`` warmed up over
    ``baseline.warmup_steps`` (``serve`` applies ``baseline.sft_schedule``), 32 windows a step, its flow noise and
    minibatch order seeded by ``algo.seed``."""
    from pi0.ript.objectives import FlowMatchingObjective
    from pi0.ript.update import OptimizerConfig, PolicyUpdate

    return PolicyUpdate(FlowMatchingObjective(policy), OptimizerConfig(
        lr=cfg.baseline.sft_lr, minibatch_size=32, warmup_steps=cfg.baseline.warmup_steps), seed=cfg.algo.seed + 3)


def serve(run_dir: Path) -> None:
    """The SFT side: train between RL's evaluations, snapshot at each (module docstring)."""
    import torch

    from pi0.ript.config.schema import load_config
    from pi0.ript.update import lr_scale_at
    from pi0.ript.utils.train_loop import tiny_warm_start

    cfg = load_config(run_dir / "config.yaml", check_paths=False)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.algo.seed + 3)
    policy, windows = tiny_warm_start(cfg)  # the RL job computed and cached it: this loads it
    upd = baseline_update(cfg, policy)
    d = run_dir / DIRNAME

    def lr_scale() -> float:  # baseline.sft_schedule at the budget fraction RL last wrote (0 before its first)
        f = d / "progress"
        return lr_scale_at(cfg.baseline.sft_schedule, float(f.read_text()) if f.is_file() else 0.0)

    (d / "ready").touch()
    steps, snaps, k = 0, [], 0
    while not (d / "stop").exists():
        if (d / f"mark_{k}").exists():
            policy.save_pretrained(d / f"snap_{k}")
            snaps.append({"mark": k, "steps": steps, "lr_scale": lr_scale()})
            (d / f"saved_{k}").touch()
            while not (d / f"go_{k}").exists() and not (d / "stop").exists():
                time.sleep(POLL_S)
            k += 1
            continue
        upd.lr_scale = lr_scale()
        upd.step(windows, max_steps=1)
        steps += 1
    (d / "log.json").write_text(json.dumps({"steps": steps, "snapshots": snaps}))


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
