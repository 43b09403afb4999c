"""``RLOptimizerPI0_CFG``: epochs x minibatches of the CFG-style flow loss, with grad accumulation,
clipping and a NaN/inf guard (a non-finite loss or gradient skips the step and is counted)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import PI0_CFG_Adapter, Window


@dataclass
class OptimizerConfig:
    """Update settings (shared by RL and the supervised warm start)."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    epochs: int = 1  # passes over the collected windows per update
    minibatch_size: int = 32  # windows per forward pass
    grad_accum_steps: int = 1  # minibatches per optimizer step
    max_grad_norm: float = 1.0  # <= 0: no clipping


class RLOptimizerPI0_CFG:
    """Runs the update of one RL iteration (or SFT steps) on a list of windows."""

    def __init__(self, adapter: PI0_CFG_Adapter, config: OptimizerConfig | None = None, seed: int = 0,
                 optimizer: torch.optim.Optimizer | None = None):
        self.adapter = adapter
        self.config = config or OptimizerConfig()
        c = self.config
        if c.minibatch_size < 1 or c.grad_accum_steps < 1 or c.epochs < 1:
            raise ValueError("epochs, minibatch_size and grad_accum_steps must be >= 1")
        params = [p for p in adapter.policy.model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.num_skipped = 0  # optimizer steps skipped for a non-finite loss / gradient (lifetime)

    def _apply(self, params: list[torch.nn.Parameter]) -> bool:
        """Clip and step; returns False (and zeroes grads) when any gradient is non-finite."""
        c = self.config
        norm = torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm if c.max_grad_norm > 0 else float("inf"))
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def step(self, windows: Sequence[Window], use_condition: bool = True, max_steps: int | None = None
             ) -> dict[str, float]:
        """Train on ``windows`` for ``epochs`` (or ``max_steps`` optimizer steps) -> mean stats.

        Stats: loss, loss_cond, loss_uncond, frac_cond, steps, skipped_steps (non-finite), update_time.
        """
        c = self.config
        if not windows:
            return {"steps": 0.0, "skipped_steps": 0.0, "update_time": 0.0}
        t0 = time.perf_counter()
        model = self.adapter.policy.model
        was_training = model.training
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        sums: dict[str, list[float]] = defaultdict(list)
        steps = skipped = 0
        self.optimizer.zero_grad(set_to_none=True)
        done = False
        for _ in range(c.epochs):
            order = self.rng.permutation(len(windows))
            mbs = [order[i: i + c.minibatch_size] for i in range(0, len(order), c.minibatch_size)]
            for j, mb in enumerate(mbs):
                batch = self.adapter.collate([windows[i] for i in mb])
                loss, st = self.adapter.loss(batch, self.generator, use_condition=use_condition)
                if not math.isfinite(float(loss.detach())):
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                for k, v in st.items():
                    sums[k].append(v)
                (loss / c.grad_accum_steps).backward()
                if (j + 1) % c.grad_accum_steps == 0 or j + 1 == len(mbs):
                    ok = self._apply(params)
                    steps += int(ok)
                    skipped += int(not ok)
                    if max_steps is not None and steps + skipped >= max_steps:
                        done = True
                        break
            if done:
                break
        model.train(was_training)
        self.num_skipped += skipped
        out = {k: float(np.mean(v)) for k, v in sums.items()}
        out.update(steps=float(steps), skipped_steps=float(skipped), update_time=time.perf_counter() - t0)
        return out
