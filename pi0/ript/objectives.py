"""What an update minimises: episodes / demos -> training windows, batches, and the three losses.

A *window* is one decision point: that decision's own observation (client images at the model's size, model-space
state, prompt tokens), a model-space action target (H, 32) with a row mask, and its episode's RLOO advantage.

One action convention, as openpi trains (``pi0.models.pi0`` loss): the flow loss runs over all 32 action dims, with
zero targets in the dims the env does not use, so the velocity the sampler integrates there is trained too.

- :class:`FlowMatchingObjective`: pi0's supervised flow-matching loss (SFT on demos; RFT on demos + own successes).
- :class:`CFGObjective`: CFGRL (Frans et al. 2025) for pi0: every window trains the reference (unconditioned) branch,
  positives (A > 0) train the optimality-conditioned branch, dropped to the reference with prob ``p_uncond``;
  sampling uses ``v_u + w (v_c - v_u)``.
- :class:`PPOObjective`: RIPT-VLA's LOOP for a flow policy: the PPO-clipped ratio of the recorded Flow-SDE step's
  log-density under the current vs the behaviour weights, times the episode's RLOO advantage (as in pi-RL / Flow-GRPO).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pi0.models.flow import sample_time
from pi0.models.flow_sde import masked_sum
from pi0.models.paligemma_with_expert import pack_kv_cache, unpack_kv_cache
from pi0.policies.normalize import normalize, unnormalize
from pi0.policies.pi0 import PI0Policy
from pi0.ript.algos.rloo import value_baselined_advantages
from pi0.ript.collection import PREFIX_KEYS
from pi0.rollout import Episode

Window = dict[str, Any]


# ---------------------------------------------------------------------------------------------- pure functions
def env_to_model_actions(policy: PI0Policy, actions: np.ndarray, model_state: np.ndarray) -> np.ndarray:
    """Env actions (R, a) + model-space state (32,) -> model-space actions (R, 32), zero in the padded dims.

    as in openpi's input transforms for training: DeltaActions (first ``delta_action_dims`` dims minus the
    state), Normalize, pad to the model's action dim with zeros.
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


def action_target(chunk: np.ndarray, env_dims: int, valid_rows: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Model-space chunk (H, A) -> (target (H, A) with zeros past ``env_dims``, mask (H, A): valid rows x ALL dims).

    as in openpi: the flow loss covers every action dim, the padded ones trained towards 0.
    """
    tgt = np.zeros_like(np.asarray(chunk, np.float32))
    tgt[:, :env_dims] = np.asarray(chunk, np.float32)[:, :env_dims]
    rows = np.ones(len(tgt), np.float32) if valid_rows is None else np.asarray(valid_rows, np.float32)
    return tgt, np.repeat(rows[:, None], tgt.shape[1], axis=1)


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


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) new / old log-probabilities and advantages -> (loss, stats).

    as in PPO (Schulman et al. 2017) and RIPT-VLA's LOOP: r = exp(logp_new - logp_old);
    loss = -mean(min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)). Stats: the clipped fraction, the mean ratio
    and approx_kl = mean((r - 1) - log r), the non-negative estimator of KL(old || new) in Schulman's "Approximating
    KL divergence" (what PPO implementations log to tune the step size: a clip fraction and KL near 0 mean the policy
    barely moved in this update).
    """
    ratio = torch.exp(logp_new - logp_old.detach())
    adv = advantages.detach().to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    with torch.no_grad():
        clip_frac = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean().item()
        log_r = (logp_new - logp_old).detach()
        approx_kl = (torch.expm1(log_r) - log_r).mean().item()
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio.detach().mean().item(), "approx_kl": approx_kl}


def stack_prefixes(prefixes: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str | None = None
                   ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Windows' prefix caches [(packed kv (depth, Tp_i, 2K, H), pad (Tp_i,))] -> (per-layer k, v (B, Tp, K, H), pad
    (B, Tp)), each right-padded to the longest Tp with zero keys marked invalid: the suffix attends to valid keys
    only and its positions count them (``PI0Model.denoise_step``), so the padding changes nothing."""
    t = max(p[1].shape[0] for p in prefixes)
    kv = torch.stack([F.pad(p[0], (0, 0, 0, 0, 0, t - p[0].shape[1])) for p in prefixes]).to(device)
    pad = torch.stack([F.pad(p[1], (0, t - p[1].shape[0])) for p in prefixes]).to(device)
    return unpack_kv_cache(kv), pad


# ---------------------------------------------------------------------------------------------- objectives
class FlowMatchingObjective:
    """pi0's flow-matching loss on windows (SFT / RFT); also builds windows from demos and rollouts and batches them."""

    def __init__(self, policy: PI0Policy):
        self.policy = policy

    # ------------------------------------------------------------------ windows
    def _window(self, ex: dict[str, Any], actions: np.ndarray, mask: np.ndarray, advantage: float, step: int,
                **more: Any) -> Window:
        if all(k in ex for k in PREFIX_KEYS):  # collection's frozen-prefix cache (SDEChunkPolicy.record_prefix)
            more["_prefix"] = tuple(ex[k] for k in PREFIX_KEYS)
        return dict(image=ex["image"], wrist_image=ex["wrist_image"], state=np.asarray(ex["state"], np.float32),
                    tokens=ex["tokenized_prompt"], token_mask=ex["tokenized_prompt_mask"], actions=actions,
                    action_mask=mask, label=float(advantage > 1e-9), advantage=float(advantage), step=step, **more)

    def episode_windows(self, episode: Episode, advantage: float = 0.0, reward: float = 0.0) -> list[Window]:
        """One window per decision point of a rollout, each with ITS OWN observation and the chunk the policy sampled
        there (``model_actions`` of ``Pi0ChunkPolicy``, or the SDE chain's last state): every row, all dims
        (``reward``: the episode's, used by PPO's value baseline only)."""
        out = []
        for d in episode.decisions:
            ex = d.extras
            if "model_actions" in ex:
                chunk = np.asarray(ex["model_actions"], np.float32)
            elif "chain" in ex:
                chunk = np.asarray(ex["chain"], np.float32)[-1]
            else:
                raise ValueError("episode decisions lack the policy's extras: collect with pi0.policies.libero."
                                 "Pi0ChunkPolicy or pi0.ript.collection.SDEChunkPolicy")
            tgt, mask = action_target(chunk, self.policy.action_dim)
            out.append(self._window(ex, tgt, mask, advantage, d.step))
        return out

    def demo_windows(self, episode: Episode, chunks: Sequence[np.ndarray]) -> list[Window]:
        """Expert episode + its full expert chunks (D, H, a) (one per decision) -> SFT windows (label 0)."""
        from pi0.policies.libero import construct_libero_observation

        mc = self.policy.config.model
        out = []
        for d, chunk in zip(episode.decisions, chunks):
            observation, arrays = construct_libero_observation([d.obs], [episode.prompt], self.policy)
            inp = self.policy.prepare_inputs(observation)
            state = inp["state"][0].cpu().numpy()
            n = min(len(chunk), mc.action_horizon)
            full = np.zeros((mc.action_horizon, mc.action_dim), np.float32)
            full[:n] = env_to_model_actions(self.policy, np.asarray(chunk)[:n], state)
            tgt, mask = action_target(full, self.policy.action_dim, np.arange(mc.action_horizon) < n)
            ex = dict(image=arrays["image"][0], wrist_image=arrays["wrist_image"][0], state=state,
                      tokenized_prompt=inp["lang_tokens"][0].cpu().numpy(),
                      tokenized_prompt_mask=inp["lang_masks"][0].cpu().numpy())
            out.append(self._window(ex, tgt, mask, 0.0, d.step, success=float(episode.success)))
        return out

    # ------------------------------------------------------------------ frozen prefix, once per window
    def attach_prefixes(self, windows: Sequence[Window], batch_size: int = 32) -> bool:
        """With a frozen prefix (``trainable=expert``): run it once per window without gradient, in batches, and keep
        its kv cache in the window ("_prefix": packed (depth, Tp, 2K, H), pad (Tp,)), so that every epoch's
        minibatches run the action expert only (the same loss values: ``PI0Model.predict_velocity(prefix=)``).
        Windows that already hold one (collection's, ``SDEChunkPolicy(record_prefix=True)``) keep it. The caller
        detaches them after its update (:meth:`detach_prefixes`), so a cache never outlives the weights it was made
        with. -> False (nothing attached) when the prefix trains or a cache cannot serve this objective."""
        if not windows or not self.policy.model.serves_cached_prefix():
            return False
        todo = [w for w in windows if "_prefix" not in w]
        with torch.no_grad():
            for i in range(0, len(todo), batch_size):
                chunk = todo[i: i + batch_size]
                b = FlowMatchingObjective.collate(self, chunk)
                cache, pad = self.policy.model.encode_prefix(b["images"], b["img_masks"], b["lang_tokens"],
                                                             b["lang_masks"])
                packed = pack_kv_cache(cache)
                for j, w in enumerate(chunk):
                    w["_prefix"] = (packed[j], pad[j])
        return True

    @staticmethod
    def detach_prefixes(windows: Sequence[Window]) -> None:
        """Drop the kv caches of :meth:`attach_prefixes` (the windows' memory back)."""
        for w in windows:
            w.pop("_prefix", None)

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
        batch = dict(images=images[:n_cam], img_masks=masks[:n_cam], lang_tokens=st("tokens", torch.long),
                     lang_masks=st("token_mask", torch.bool), state=st("state", torch.float32),
                     actions=st("actions", torch.float32), action_mask=st("action_mask", torch.float32),
                     label=st("label", torch.float32), advantage=st("advantage", torch.float32))
        if all("_prefix" in w for w in windows) and self.policy.model.serves_cached_prefix():
            batch["prefix"] = stack_prefixes([w["_prefix"] for w in windows], dev)
        return batch

    def per_sample_flow_loss(self, batch: dict[str, torch.Tensor], condition: torch.Tensor | None,
                             generator: torch.Generator | None) -> torch.Tensor:
        """Flow-matching loss per window (B,) at fresh noise and time (``condition``: CFG inputs or None)."""
        b, h, a = batch["actions"].shape
        dev = batch["actions"].device
        noise = torch.randn(b, h, a, generator=generator).to(dev)
        time = sample_time(b, generator=generator).to(dev)
        sq = self.policy.model(batch["images"], batch["img_masks"], batch["lang_tokens"], batch["lang_masks"],
                               batch["state"], batch["actions"], noise=noise, time=time, condition=condition,
                               prefix=batch.get("prefix"))
        return masked_flow_loss(sq, batch["action_mask"])

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean flow-matching loss (scalar) + stats."""
        loss = self.per_sample_flow_loss(batch, None, generator).mean()
        return loss, {"loss": float(loss.detach())}


class CFGObjective(FlowMatchingObjective):
    """CFGRL's advantage-conditioned flow-matching loss (module docstring)."""

    def __init__(self, policy: PI0Policy, p_uncond: float = 0.3):
        if not 0.0 <= p_uncond <= 1.0:
            raise ValueError(f"p_uncond must be in [0, 1], got {p_uncond}")
        super().__init__(policy)
        self.p_uncond = float(p_uncond)

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """CFG loss (scalar) + stats (loss per branch, fraction conditioned)."""
        labels = batch["label"]
        cond = None
        if self.policy.model.cfg.optimality_condition:
            cond = cfg_condition_inputs(labels.cpu(), self.p_uncond, generator).to(labels.device)
        per = self.per_sample_flow_loss(batch, cond, generator)
        loss = per.mean()
        is_c = cond if cond is not None else torch.zeros_like(per)
        stats = {"loss": float(loss.detach()), "frac_cond": float(is_c.mean())}
        for name, m in (("loss_cond", is_c > 0), ("loss_uncond", is_c <= 0)):
            if bool(m.any()):
                stats[name] = float(per.detach()[m].mean())
        return loss, stats


class PPOObjective(FlowMatchingObjective):
    """LOOP for pi0 (module docstring): windows of SDE-collected episodes carry the denoising chain, the stochastic
    step and the behaviour log-density (summed over the executed rows x env action dims, the part that reached the
    env); the loss is :func:`clipped_surrogate` of the recomputed log-density.

    ``value_baseline`` (the policy needs its value head): each decision's advantage is the episode's RLOO advantage
    minus the value head's change since the episode's first decision (``value_baselined_advantages``, values recorded
    at collection), and the loss adds the head's squared error to the episode's reward (the head's features are
    detached, so that term trains the head alone)."""

    def __init__(self, policy: PI0Policy, noise_level: float, clip: float = 0.2, value_baseline: bool = False,
                 sde_kind: str = "flow_sde"):
        super().__init__(policy)
        self.noise_level, self.clip, self.sde_kind = float(noise_level), float(clip), sde_kind
        if value_baseline and not policy.model.cfg.value_head:
            raise ValueError("value_baseline needs the policy's value head: call policy.model.enable_value_head()")
        self.value_baseline = bool(value_baseline)

    def episode_windows(self, episode: Episode, advantage: float = 0.0, reward: float = 0.0) -> list[Window]:
        """One window per decision point: its observation, chain, stochastic step, executed mask, old log-prob
        (and with the value baseline its own advantage and the episode's reward, the head's target)."""
        advs = [advantage] * len(episode.decisions)
        if self.value_baseline and episode.decisions:
            if any("value" not in d.extras for d in episode.decisions):
                raise ValueError("episode decisions lack the value head's 'value': collect with a value-head policy")
            advs = value_baselined_advantages(advantage, np.array([float(d.extras["value"])
                                                                   for d in episode.decisions]))
        out = []
        for d, adv in zip(episode.decisions, advs):
            ex = d.extras
            if "chain" not in ex:
                raise ValueError("episode decisions lack SDE extras: collect with pi0.ript.collection.SDEChunkPolicy")
            chain = np.asarray(ex["chain"], np.float32)
            mask = np.zeros(chain.shape[1:], np.float32)  # (H, A): the executed rows x the env's action dims
            mask[: d.num_executed, : self.policy.action_dim] = 1.0
            logp_old = float((np.asarray(ex["log_prob"], np.float64) * mask).sum())
            out.append(self._window(ex, chain[-1], mask, float(adv), d.step, chain=chain, sde_step=int(ex["sde_step"]),
                                    logp_old=logp_old, ret=float(reward)))
        return out

    def collate(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        """The flow batch + chain (B,N+1,H,A), sde_step (B,), logp_old (B,) (+ ret (B,) with the value baseline)."""
        batch = super().collate(windows)
        dev = batch["state"].device
        batch["chain"] = torch.as_tensor(np.stack([w["chain"] for w in windows])).to(dev)
        batch["sde_step"] = torch.tensor([w["sde_step"] for w in windows], device=dev)
        batch["logp_old"] = torch.tensor([w["logp_old"] for w in windows], dtype=torch.float32, device=dev)
        if self.value_baseline:  # the value head's target: the episode's reward
            batch["ret"] = torch.tensor([w["ret"] for w in windows], dtype=torch.float32, device=dev)
        return batch

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """LOOP: the clipped surrogate of the chunk log-prob ratio and the advantages (+ the value head's squared
        error) (scalar) + stats."""
        out = self.policy.model.step_log_prob(batch["images"], batch["img_masks"], batch["lang_tokens"],
                                              batch["lang_masks"], batch["state"], batch["chain"], batch["sde_step"],
                                              self.policy.config.num_steps, self.noise_level,
                                              return_value=self.value_baseline, prefix=batch.get("prefix"),
                                              sde_kind=self.sde_kind)
        lp, value = out if self.value_baseline else (out, None)
        logp_new = masked_sum(lp, batch["action_mask"])
        loss, st = clipped_surrogate(logp_new, batch["logp_old"], batch["advantage"], self.clip, self.clip)
        st = {"loss": float(loss.detach()), **st}
        if value is not None:  # detached features: this term's gradient reaches the value head only
            value_loss = ((value - batch["ret"]) ** 2).mean()
            loss = loss + value_loss
            st["value_loss"] = float(value_loss.detach())
        return loss, st


OBJECTIVES = ("ppo", "cfg")
