"""The one update step of RL and SFT alike: epochs x minibatches of an objective's loss, gradients averaged over
ranks, clipping, and a non-finite guard. On one process the reductions are no-ops.

Every rank runs the same number of optimizer steps and collectives, so DDP-style training cannot deadlock: the step
count is the max over ranks of ``epochs x ceil(ceil(windows / minibatch) / grad_accum)``; a rank that runs out of
minibatches (or has none) contributes zero gradients. Gradients are summed over ranks and divided by the global number
of minibatches in the step, so the update equals single-process training on the union of the ranks' minibatches.
A non-finite loss masks its minibatch out; a non-finite reduced gradient skips the step (same decision everywhere).

Under FSDP2 (``pi0.ript.utils.fsdp``) the gradients arrive reduce-scattered (averaged over ranks) and are rescaled to
the same global mean; since every forward and backward is itself a collective there, a rank pads its accumulation
group with zero-weighted minibatches of a template window (its own, or one gathered from another rank) rather than
skipping them, and a non-finite loss is back-propagated and skips the whole step through the global gradient norm.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pi0.ript.objectives import FlowMatchingObjective, Window
from pi0.ript.utils.dist_utils import DistInfo
from pi0.ript.utils.fsdp import full_value, is_sharded


LR_SCHEDULES = ("constant", "cosine")  # an arm's lr multiplier over its budget (lr_scale_at)


def lr_scale_at(schedule: str, frac: float) -> float:
    """The lr multiplier of ``schedule`` at ``frac`` of the budget: 1 for ``constant``; for ``cosine`` a half cosine
    from 1 at 0 to 0 at 1 (clamped to [0, 1])."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, frac))))
    raise ValueError(f"unknown lr schedule {schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")


@dataclass
class OptimizerConfig:
    """Update settings (shared by RL and the supervised warm start)."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    epochs: int = 1  # passes over the collected windows per update
    minibatch_size: int = 32  # windows per forward pass
    grad_accum_steps: int = 1  # minibatches per optimizer step
    max_grad_norm: float = 1.0  # <= 0: no clipping (per parameter group: the policy, the value head)
    value_lr: float = 1e-3  # the value head's lr (PPO's value baseline; a small fresh head, trained alone)
    warmup_steps: int = 0  # the first optimizer steps scale the lr linearly from 1/warmup_steps to 1 (fresh AdamW)


@dataclass
class DemoAnchor:
    """A supervised term in every minibatch of an update: ``coef`` x pi0's flow-matching loss on ``batch_size``
    windows drawn from ``windows`` (the demos), added to the objective's loss.

    as in DAPG (Rajeswaran et al. 2018, "Learning Complex Dexterous Manipulation with Deep RL and Demonstrations"):
    the policy gradient plus a behaviour-cloning term on the demonstrations; here with a constant weight."""

    windows: Sequence[Window]
    coef: float
    batch_size: int = 32


def is_value_param(name: str) -> bool:
    """True for the value head's parameters (``PI0Model.value_head``; FSDP2 keeps the name)."""
    return name.startswith("value_head.") or ".value_head." in name


class PolicyUpdate:
    """AdamW over the trainable parameters of ``objective.policy``; :meth:`step` trains on a list of windows."""

    def __init__(self, objective: FlowMatchingObjective, config: OptimizerConfig | None = None, seed: int = 0,
                 info: DistInfo | None = None, anchor: DemoAnchor | None = None):
        self.objective = objective
        self.config = c = config or OptimizerConfig()
        if c.minibatch_size < 1 or c.grad_accum_steps < 1 or c.epochs < 1:
            raise ValueError("epochs, minibatch_size and grad_accum_steps must be >= 1")
        if anchor is not None and (not anchor.windows or anchor.coef <= 0 or anchor.batch_size < 1):
            raise ValueError(f"a demo anchor needs demo windows, coef > 0 and batch_size >= 1 (got "
                             f"{len(anchor.windows)} windows, coef {anchor.coef}, batch_size {anchor.batch_size})")
        self.anchor = anchor
        # the anchor's own flow loss, demo draws and flow noise (the objective's streams stay as without it)
        self.anchor_objective = FlowMatchingObjective(objective.policy) if anchor is not None else None
        self.anchor_rng = np.random.default_rng(seed + 1)
        self.anchor_generator = torch.Generator().manual_seed(seed + 1)
        self.info = info or DistInfo()
        self.sharded = is_sharded(objective.policy.model)  # FSDP2: params, grads and AdamW state are rank shards
        self._template: Window | None = None  # FSDP2: a window for zero-weighted padding minibatches
        named = [(n, p) for n, p in objective.policy.model.named_parameters() if p.requires_grad]
        named.sort(key=lambda np_: is_value_param(np_[0]))  # the policy's parameters first, then the value head's
        self.params = [p for _, p in named]
        self.num_value = sum(is_value_param(n) for n, _ in named)
        if len(self.params) == self.num_value:
            raise ValueError("the policy has no trainable parameters (PI0Model.set_trainable)")
        # mixed precision: trainable parameters stored in bf16 get float32 master copies; AdamW (and its state) runs
        # on the masters, and each step writes them back rounded to bf16. Float32 parameters are their own masters.
        # Under FSDP2 the float32 shards are the masters (bf16 is only the gathered compute copy).
        self.masters = [p if p.dtype == torch.float32 or self.sharded
                        else p.detach().float().clone().requires_grad_(True) for p in self.params]
        n_pol = len(self.masters) - self.num_value
        groups = [{"params": self.masters[:n_pol]}]
        if self.num_value:  # the value head: its own lr and its own clipping (its gradient never scales the policy's)
            groups.append({"params": self.masters[n_pol:], "lr": c.value_lr})
        self.optimizer = torch.optim.AdamW(groups, lr=c.lr, weight_decay=c.weight_decay)
        self.generator = torch.Generator().manual_seed(seed)  # flow noise / time / condition dropout
        self.rng = np.random.default_rng(seed)  # minibatch order
        self.num_skipped = 0  # optimizer steps skipped for a non-finite loss / gradient (lifetime)
        self.num_applied = 0  # optimizer steps applied (lifetime): the warm-up's position
        self.lr_scale = 1.0  # a caller's schedule (e.g. cosine over a wall-clock budget), times the warm-up

    @property
    def adapter(self) -> FlowMatchingObjective:  # the seed's name for the objective
        return self.objective

    def _allreduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.info.enabled:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _reduce_grads(self, used: int) -> float:
        """Sum the gradients and the minibatch count over ranks (one flat all-reduce; nothing on one process), put
        grad / count on the float32 masters -> the global minibatch count."""
        if self.sharded:  # FSDP2 reduce-scattered the mean over ranks: times world / global count
            total = float(self._allreduce(torch.tensor([float(used)]))[0])
            for p in self.params:
                if p.grad is not None:
                    if total:
                        p.grad.mul_(self.info.world_size / total)
                    else:
                        p.grad = None
            return total
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.info.enabled:
            flat = torch.cat([g.reshape(-1).float() for g in grads]
                             + [torch.tensor([float(used)], device=self.params[0].device)])
            self._allreduce(flat)
            total = float(flat[-1])
            grads = list(torch.split(flat[:-1], [p.numel() for p in self.params]))
        else:
            total = float(used)
        for p, m, g in zip(self.params, self.masters, grads):
            m.grad = (g.view_as(p).float() / total) if total else None
            if m is not p:
                p.grad = None  # the bf16 gradient is spent
        return total

    def _gather_template(self) -> Window:
        """FSDP2: the first rank's template window, for ranks that have none (every rank calls it)."""
        got: list[Window | None] = [None] * self.info.world_size
        dist.all_gather_object(got, self._template)
        return next(w for w in got if w is not None)

    def _apply(self) -> bool:
        """Clip each parameter group and step (on the float32 masters); False (grads zeroed) when a gradient norm is
        non-finite."""
        c = self.config
        for group in self.optimizer.param_groups:
            norm = torch.nn.utils.clip_grad_norm_(group["params"], c.max_grad_norm if c.max_grad_norm > 0
                                                  else float("inf"))
            if not torch.isfinite(full_value(norm)):
                self.optimizer.zero_grad(set_to_none=True)
                return False
        scale = self.lr_scale * (min(1.0, (self.num_applied + 1) / c.warmup_steps) if c.warmup_steps > 0 else 1.0)
        if scale != 1.0:  # multiplies whatever lr a scheduler set, for this step only
            lrs = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] *= scale
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        else:
            self.optimizer.step()
        self.num_applied += 1
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)  # rounded to the parameter's bf16
        return True

    def _anchored(self, loss: torch.Tensor, st: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective's minibatch loss plus the demo anchor's term (:class:`DemoAnchor`) -> (loss, stats)."""
        a, obj = self.anchor, self.anchor_objective
        idx = self.anchor_rng.choice(len(a.windows), size=min(a.batch_size, len(a.windows)), replace=False)
        demo_loss, _ = obj.loss(obj.collate([a.windows[i] for i in idx]), self.anchor_generator)
        return loss + a.coef * demo_loss, {**st, "demo_loss": float(demo_loss.detach())}

    def step(self, windows: Sequence[Window], max_steps: int | None = None) -> dict[str, float]:
        """Train on ``windows`` for ``epochs`` (or ``max_steps`` optimizer steps) -> mean stats.

        Stats: the objective's (loss, ...), steps, skipped_steps (non-finite), update_time. Every rank must call it,
        also with no windows.
        """
        c = self.config
        t0 = time.perf_counter()
        model = self.objective.policy.model
        was_training = model.training
        model.train()
        mbs: list[np.ndarray] = []
        for _ in range(c.epochs):
            order = self.rng.permutation(len(windows)) if windows else np.zeros(0, int)
            mbs += [order[i: i + c.minibatch_size] for i in range(0, len(order), c.minibatch_size)]
        local_steps = math.ceil(len(mbs) / c.grad_accum_steps)
        if self.sharded and windows:
            self._template = windows[0]
        need_template = int(self.sharded and self._template is None)
        flags = self._allreduce(torch.tensor([local_steps, need_template], dtype=torch.int64), dist.ReduceOp.MAX
                                if self.info.enabled else None)
        n_steps = int(flags[0])
        if n_steps and int(flags[1]):  # FSDP2: a rank without any window yet borrows one for its padding
            self._template = self._gather_template()
        if max_steps is not None:
            n_steps = min(n_steps, max_steps)
        # a frozen prefix (trainable=expert) runs once per window and step, not once per epoch (same loss values);
        # windows may already hold collection's (SDEChunkPolicy.record_prefix): then it does not run at all
        cached = (c.epochs > 1 and n_steps > 0 and not self.sharded
                  and self.objective.attach_prefixes(windows, c.minibatch_size))
        sums: dict[str, list[float]] = {}
        steps = skipped = 0
        for s in range(n_steps):
            self.optimizer.zero_grad(set_to_none=False)
            for p in self.params:
                p.grad = None
            mine: list[np.ndarray | None] = list(mbs[s * c.grad_accum_steps: (s + 1) * c.grad_accum_steps])
            if self.sharded:  # FSDP2: the same number of forwards/backwards on every rank (module docstring)
                mine += [None] * (c.grad_accum_steps - len(mine))
            used = 0
            for mb in mine:
                batch = [windows[i] for i in mb] if mb is not None else [self._template]
                loss, st = self.objective.loss(self.objective.collate(batch), self.generator)
                if self.anchor is not None:
                    loss, st = self._anchored(loss, st)
                finite = math.isfinite(float(loss.detach()))
                if self.sharded:
                    (loss * float(mb is not None)).backward()
                elif finite:
                    loss.backward()
                if mb is None or not finite:
                    continue  # padding, or masked out: the rank still joins the reduction below
                for k, v in st.items():
                    sums.setdefault(k, []).append(v)
                used += 1
            total = self._reduce_grads(used)  # averaged over every rank's minibatches, onto the masters
            if total == 0:  # every rank's minibatches were empty / non-finite: nothing to apply
                skipped += int(any(m is not None for m in mine))
                continue
            ok = self._apply()
            steps += int(ok)
            skipped += int(not ok)
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if cached:  # a cache never outlives the weights it was made with (collection's go with the windows)
            self.objective.detach_prefixes(windows)
        model.train(was_training)
        self.num_skipped += skipped
        out = {k: float(np.mean(v)) for k, v in sums.items()}
        out.update(steps=float(steps), skipped_steps=float(skipped), update_time=time.perf_counter() - t0)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and both RNGs (resume)."""
        return {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "rng": self.rng.bit_generator.state, "num_skipped": self.num_skipped, "num_applied": self.num_applied,
                "anchor_generator": self.anchor_generator.get_state(),
                "anchor_rng": self.anchor_rng.bit_generator.state}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        if st.get("optimizer") is not None:  # None: FSDP2's sharded state, loaded by pi0.ript.checkpoint
            self.optimizer.load_state_dict(st["optimizer"])
        self.generator.set_state(st["generator"])
        self.rng.bit_generator.state = st["rng"]
        self.num_skipped = int(st.get("num_skipped", 0))
        self.num_applied = int(st.get("num_applied", 0))
        if "anchor_rng" in st:
            self.anchor_generator.set_state(st["anchor_generator"])
            self.anchor_rng.bit_generator.state = st["anchor_rng"]
