"""RIPT-VLA's LOOP for flow policies: RLOO advantages x PPO-clipped ratios of Flow-SDE chunk log-probabilities.

``clipped_surrogate`` is the pure loss; ``SDEChunkPolicy`` collects with the stochastic sampler and records the
denoising chain; ``PI0_PPO_Adapter`` turns those episodes into windows and evaluates the loss (the optimizer loop is
the CFG objective's ``RLOptimizerPI0_CFG``: epochs x minibatches, clipping, a non-finite guard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pi0.models.flow_sde import masked_sum
from pi0.policies.libero import construct_libero_observation, window_extras
from pi0.rollout import Episode
from pi0.rollout.types import PolicyOutput
from pi0.ript.algos.rl_optimizers.pi0_cfg_interface import PI0_CFG_Adapter, Window


def clipped_surrogate(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) new / old log-probabilities and advantages -> (loss, stats).

    as in PPO (Schulman et al. 2017) and RIPT-VLA's LOOP: r = exp(logp_new - logp_old);
    loss = -mean(min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)). Stats: the clipped fraction and the mean ratio.
    """
    ratio = torch.exp(logp_new - logp_old.detach())
    adv = advantages.detach().to(ratio.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    with torch.no_grad():
        clip_frac = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean().item()
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio.detach().mean().item()}


# ---------------------------------------------------------------------------------------------- collection
class SDEChunkPolicy:
    """Batched ``ChunkPolicy`` that samples with Flow-SDE (``PI0Model.sample_actions_sde``) and records, per decision,
    what the PPO update needs: the denoising chain, the stochastic step and its elementwise log-density, beside the
    observation extras of ``Pi0ChunkPolicy`` (client images, model-space state, prompt tokens)."""

    def __init__(self, policy: Any, noise_level: float, generator: torch.Generator | None = None):
        self.policy, self.noise_level, self.generator = policy, float(noise_level), generator

    @torch.no_grad()
    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """n raw observations -> PolicyOutput(actions (n, H, 7) float64, extras incl. chain / sde_step / log_prob)."""
        pol = self.policy
        observation, arrays = construct_libero_observation(obs, prompts, pol)
        inp = pol.prepare_inputs(observation)
        cfg = pol.config.model
        noise = torch.randn(len(obs), cfg.action_horizon, cfg.action_dim, generator=self.generator).to(pol.device)
        rec = pol.model.sample_actions_sde(inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"],
                                           inp["state"], noise, pol.config.num_steps, self.noise_level,
                                           generator=self.generator)
        actions = pol.postprocess_actions(rec["actions"], inp["state"])
        extras = {**window_extras(arrays, inp["state"], inp["lang_tokens"], inp["lang_masks"]),
                  "chain": rec["chain"].cpu().numpy(), "sde_step": np.full(len(obs), rec["sde_step"]),
                  "log_prob": rec["log_prob"].cpu().numpy()}
        return PolicyOutput(actions=actions.numpy(), extras=extras)


# ---------------------------------------------------------------------------------------------- update
class PI0_PPO_Adapter(PI0_CFG_Adapter):
    """Windows of SDE-collected episodes and the LOOP loss: the PPO-clipped ratio of the recorded stochastic step's
    log-density (summed over the executed steps x env action dims) under new vs behaviour weights, times the episode's
    RLOO advantage. Batching (images, tokens, state) is the CFG adapter's."""

    def __init__(self, policy: Any, noise_level: float, clip: float = 0.2):
        super().__init__(policy, target="model_actions", p_uncond=0.0)
        self.noise_level, self.clip = float(noise_level), float(clip)

    def episode_windows(self, episode: Episode, advantage: float = 0.0) -> list[Window]:
        """One window per decision point: its observation, chain, stochastic step, executed mask and old log-prob."""
        out = []
        for d in episode.decisions:
            ex = d.extras
            if "chain" not in ex:
                raise ValueError("episode decisions lack SDE extras: collect with pi0.ript.algos.ppo.SDEChunkPolicy")
            chain = np.asarray(ex["chain"], np.float32)
            mask = np.zeros(chain.shape[1:], np.float32)  # (H, A): the executed steps x the env's action dims
            mask[: d.num_executed, : self.policy.action_dim] = 1.0
            logp_old = float((np.asarray(ex["log_prob"], np.float64) * mask).sum())
            out.append(dict(image=ex["image"], wrist_image=ex["wrist_image"], state=np.asarray(ex["state"], np.float32),
                            tokens=ex["tokenized_prompt"], token_mask=ex["tokenized_prompt_mask"], actions=chain[-1],
                            action_mask=mask, chain=chain, sde_step=int(ex["sde_step"]), logp_old=logp_old,
                            label=float(advantage > 1e-9), advantage=float(advantage), step=d.step,
                            success=float(episode.success)))
        return out

    def collate(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        """The CFG adapter's batch + chain (B,N+1,H,A), sde_step (B,), logp_old (B,)."""
        batch = super().collate(windows)
        dev = batch["state"].device
        batch["chain"] = torch.as_tensor(np.stack([w["chain"] for w in windows])).to(dev)
        batch["sde_step"] = torch.tensor([w["sde_step"] for w in windows], device=dev)
        batch["logp_old"] = torch.tensor([w["logp_old"] for w in windows], dtype=torch.float32, device=dev)
        return batch

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
             use_condition: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """LOOP: the clipped surrogate of the chunk log-prob ratio and the RLOO advantages (scalar) + stats."""
        model = self.policy.model
        lp = model.step_log_prob(batch["images"], batch["img_masks"], batch["lang_tokens"], batch["lang_masks"],
                                 batch["state"], batch["chain"], batch["sde_step"], self.policy.config.num_steps,
                                 self.noise_level)
        logp_new = masked_sum(lp, batch["action_mask"])
        loss, st = clipped_surrogate(logp_new, batch["logp_old"], batch["advantage"], self.clip, self.clip)
        return loss, {"loss": float(loss.detach()), **st}
