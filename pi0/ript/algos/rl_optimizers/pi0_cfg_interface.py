"""``PI0_CFG_Adapter``: rollouts / demos -> pi0 training windows, and the CFG-style flow-matching loss.

A *window* is one decision point: that decision's own observation (client images at the model's size,
model-space state, prompt tokens), a model-space action target (H, 32) with a mask, the optimality label
and a weight. Targets: ``"model_actions"`` (the normalized chunk the policy sampled there) or ``"executed"``
(the env actions actually executed, mapped back to model space, padded and masked at episode end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pi0.models.flow import sample_time
from pi0.policies.pi0 import PI0Policy
from pi0.policies.normalize import normalize, unnormalize
from pi0.rollout import Episode

Window = dict[str, Any]
TARGETS = ("model_actions", "executed")


def env_to_model_actions(policy: PI0Policy, actions: np.ndarray, model_state: np.ndarray) -> np.ndarray:
    """Env actions (R, a) + model-space state (32,) -> model-space actions (R, 32) (inverse of postprocess).

    as in openpi's input transforms for training: DeltaActions (first ``delta_action_dims`` dims minus the
    state), Normalize, pad to the model's action dim.
    """
    cfg = policy.config
    mode = cfg.normalization
    a = torch.as_tensor(np.asarray(actions, np.float64)).clone()
    d = cfg.delta_action_dims
    if d:
        state_rt = unnormalize(torch.as_tensor(model_state, dtype=torch.float64)[None], policy.norm_stats["state"], mode)
        a[:, :d] -= state_rt[0, :d].to(a.dtype)
    a = normalize(a, policy.norm_stats["actions"], mode).to(torch.float32)
    out = np.zeros((a.shape[0], cfg.model.action_dim), np.float32)
    out[:, : a.shape[1]] = a.numpy()
    return out


def masked_flow_loss(sq_err: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-element squared error (B,H,A) and mask (B,H,A) -> per-sample masked mean (B,) (0 where mask is empty)."""
    m = mask.to(sq_err.dtype)
    return (sq_err * m).sum((1, 2)) / m.sum((1, 2)).clamp_min(1.0)


def cfg_condition_inputs(labels: torch.Tensor, p_uncond: float, generator: torch.Generator | None = None
                         ) -> torch.Tensor:
    """Optimality labels (B,) -> condition inputs (B,) in {0,1}: label, dropped to 0 with prob ``p_uncond``.

    as in CFGRL / classifier-free guidance training: one network learns both branches; a non-positive
    sample always trains the unconditioned branch.
    """
    keep = torch.rand(labels.shape[0], generator=generator) >= p_uncond
    return (labels.bool() & keep).float()


class PI0_CFG_Adapter:
    """Turns episodes (with ``Pi0ChunkPolicy`` extras) and expert demos into windows, batches and losses."""

    def __init__(self, policy: PI0Policy, target: str = "model_actions", p_uncond: float = 0.3,
                 advantage_weighting: bool = False, negative_weight: float = 1.0, coupled_noise: bool = False):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        if not 0.0 <= p_uncond <= 1.0:
            raise ValueError(f"p_uncond must be in [0, 1], got {p_uncond}")
        self.policy = policy
        self.target = target
        self.p_uncond = float(p_uncond)
        self.advantage_weighting = advantage_weighting
        self.negative_weight = float(negative_weight)  # loss weight of non-positive windows (1 = plain CFGRL)
        # model_actions targets: train on the (flow noise, sampled chunk) pair the policy produced instead of fresh
        # noise (the coupling of Rectified Flow's reflow, Liu et al. 2022, a fixed point of the Euler sampler).
        # Measured (bench/results/rl_diagnosis.md): it does NOT stop repeated self-distillation from degrading the
        # tiny arena policy (held-out 0.24 -> 0.05 in 12 rounds, vs 0.02 with fresh noise), so it is off by default.
        self.coupled_noise = bool(coupled_noise)

    # ------------------------------------------------------------------ windows
    def _target(self, actions: np.ndarray, valid: np.ndarray, model_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Executed env actions (R, a) + valid (R,) -> padded model-space target (H, 32) and mask (H, 32)."""
        mc = self.policy.config.model
        h, n = mc.action_horizon, min(len(actions), mc.action_horizon)
        tgt = np.zeros((h, mc.action_dim), np.float32)
        mask = np.zeros((h, mc.action_dim), np.float32)
        tgt[:n] = env_to_model_actions(self.policy, actions[:n], model_state)
        mask[:n, : self.policy.action_dim] = np.asarray(valid[:n], np.float32)[:, None]
        return tgt, mask

    def episode_windows(self, episode: Episode, advantage: float = 0.0) -> list[Window]:
        """One window per decision point of ``episode``, each with ITS OWN observation; label = advantage > 0."""
        out = []
        for d in episode.decisions:
            ex = d.extras
            if "model_actions" not in ex:
                raise ValueError("episode decisions lack Pi0ChunkPolicy extras (collect with pi0.policies.libero."
                                 "Pi0ChunkPolicy)")
            noise = None
            if self.target == "model_actions":
                tgt = np.asarray(ex["model_actions"], np.float32)
                mask = np.zeros_like(tgt)  # only the env's action dims: the padded dims are never executed
                mask[:, : self.policy.action_dim] = 1.0
                if self.coupled_noise:
                    noise = np.asarray(ex["noise"], np.float32)
            else:
                tgt, mask = self._target(d.actions, d.valid, ex["state"])
            out.append(dict(image=ex["image"], wrist_image=ex["wrist_image"], state=np.asarray(ex["state"], np.float32),
                            tokens=ex["tokenized_prompt"], token_mask=ex["tokenized_prompt_mask"], actions=tgt,
                            action_mask=mask, label=float(advantage > 1e-9), advantage=float(advantage), step=d.step,
                            noise=noise, demo=0.0))
        return out

    def demo_windows(self, episode: Episode, chunks: Sequence[np.ndarray]) -> list[Window]:
        """Expert episode + its full expert chunks (D, H, a) (one per decision) -> windows (label 0: SFT; ``success``:
        the demo's outcome, for a demo anchor)."""
        from pi0.policies.libero import construct_libero_observation

        out = []
        for d, chunk in zip(episode.decisions, chunks):
            observation, arrays = construct_libero_observation([d.obs], [episode.prompt], self.policy)
            inp = self.policy.prepare_inputs(observation)
            state = inp["state"][0].cpu().numpy()
            tgt, mask = self._target(np.asarray(chunk), np.ones(len(chunk), bool), state)
            out.append(dict(image=arrays["image"][0], wrist_image=arrays["wrist_image"][0], state=state,
                            tokens=inp["lang_tokens"][0].cpu().numpy(), token_mask=inp["lang_masks"][0].cpu().numpy(),
                            actions=tgt, action_mask=mask, label=0.0, advantage=0.0, step=d.step, demo=1.0,
                            success=float(episode.success)))
        return out

    # ------------------------------------------------------------------ batches and loss
    def collate(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        """Windows -> model batch: images 2 x (B,3,S,S) in [-1,1], masks, tokens, state (B,32), actions, ..."""
        dev = self.policy.device
        st = lambda k, dt=None: torch.as_tensor(np.stack([w[k] for w in windows]), dtype=dt).to(dev)  # noqa: E731
        img = lambda k: st(k).permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0  # noqa: E731
        b = len(windows)
        n_cam = self.policy.config.model.num_cameras
        images = [img("image"), img("wrist_image")]
        masks = [torch.ones(b, dtype=torch.bool, device=dev)] * 2
        while len(images) < n_cam:  # absent cameras (right wrist): zero image, mask False, as at inference
            images.append(torch.full_like(images[0], -1.0))
            masks.append(torch.zeros(b, dtype=torch.bool, device=dev))
        # (B,) which windows bring their own flow noise (H, 32); the others get fresh noise in ``loss``
        has = torch.tensor([w.get("noise") is not None for w in windows], device=dev)
        noise = torch.stack([torch.as_tensor(w["noise"]) if w.get("noise") is not None
                             else torch.zeros(w["actions"].shape) for w in windows]).float().to(dev)
        return dict(images=images[:n_cam], img_masks=masks[:n_cam], lang_tokens=st("tokens", torch.long),
                    noise=noise, has_noise=has,
                    lang_masks=st("token_mask", torch.bool), state=st("state", torch.float32),
                    actions=st("actions", torch.float32), action_mask=st("action_mask", torch.float32),
                    label=st("label", torch.float32), advantage=st("advantage", torch.float32),
                    demo=torch.tensor([float(w.get("demo", 0.0)) for w in windows], device=dev))

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
             use_condition: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """CFG-style flow-matching loss (scalar) on a batch + stats (loss per branch, fraction conditioned).

        Positives train the conditioned branch (prob 1 - p_uncond) or the unconditioned one; the rest train
        the unconditioned branch. ``advantage_weighting`` scales positive-branch losses by A / mean(A+).
        """
        model = self.policy.model
        labels = batch["label"]
        cond = None
        if use_condition and model.cfg.optimality_condition:
            cond = cfg_condition_inputs(labels.cpu(), self.p_uncond, generator).to(labels.device)
        b, h, a = batch["actions"].shape
        noise = torch.randn(b, h, a, generator=generator).to(labels.device)
        if "has_noise" in batch:  # the sampler's own noise for its own chunks (reflow coupling)
            noise = torch.where(batch["has_noise"][:, None, None], batch["noise"], noise)
        time = sample_time(b, generator=generator).to(labels.device)
        sq = model(batch["images"], batch["img_masks"], batch["lang_tokens"], batch["lang_masks"], batch["state"],
                   batch["actions"], noise=noise, time=time, condition=cond)
        per = masked_flow_loss(sq, batch["action_mask"])  # (B,)
        weights = torch.ones_like(per)
        is_c = cond if cond is not None else torch.zeros_like(per)
        if self.advantage_weighting and cond is not None and bool((is_c > 0).any()):
            adv = batch["advantage"].clamp_min(0)
            weights = torch.where(is_c > 0, adv / adv[is_c > 0].mean().clamp_min(1e-6), weights)
        if self.negative_weight != 1.0:  # rollout windows with A <= 0 only: expert demos (anchors) keep weight 1
            keep = (labels > 0) | (batch["demo"] > 0) if "demo" in batch else labels > 0
            weights = torch.where(keep, weights, torch.full_like(weights, self.negative_weight))
        loss = (per * weights).mean()
        stats = {"loss": float(loss.detach()), "frac_cond": float(is_c.mean())}
        for name, m in (("loss_cond", is_c > 0), ("loss_uncond", is_c <= 0)):
            if bool(m.any()):
                stats[name] = float(per.detach()[m].mean())
        return loss, stats
