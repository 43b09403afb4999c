"""openpi's whole pi0_libero policy path: raw LIBERO observation -> PI0Policy -> 7-D env action chunk.

Client steps (``pi0.transforms``: rotate 180, resize_with_pad 224, 8-D state) then ``PI0Policy``'s input
transforms (z-score, pad to 32, tokenize) and output transforms (unnormalize, delta -> absolute on the
first 6 dims, keep 7). ``Pi0ChunkPolicy`` adapts it to the rollout engine's batched ``ChunkPolicy``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pi0.modeling_pi0 import Observation, PI0Policy
from pi0.rollout.types import PolicyOutput
from pi0.transforms import libero_client_obs


def construct_pi0_observation(env_obs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                              prompt: str | Sequence[str], size: int = 224
                              ) -> tuple[Observation, dict[str, np.ndarray]]:
    """Raw LIBERO obs (one dict or a list of B) + prompt(s) -> (PI0Policy observation, client arrays).

    as in openpi examples/libero/main.py + LiberoInputs: base_0_rgb = agentview, left_wrist_0_rgb =
    wrist camera, right wrist absent (zero image, mask False); state stays float64 until normalized.
    The client arrays are image/wrist_image (B,size,size,3) uint8 and state (B,8) float64; ``size`` is the
    model's image size (224 for pi0; smaller for tiny models).
    """
    obs_list = [env_obs] if isinstance(env_obs, Mapping) else list(env_obs)
    prompts = [prompt] * len(obs_list) if isinstance(prompt, str) else list(prompt)
    if len(prompts) != len(obs_list):
        raise ValueError(f"{len(prompts)} prompts for {len(obs_list)} observations")
    client = [libero_client_obs(o, size) for o in obs_list]
    arrays = {k: np.stack([c[k] for c in client]) for k in ("image", "wrist_image", "state")}
    chw = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))  # noqa: E731
    observation: Observation = {
        "image": {"base_0_rgb": chw(arrays["image"]), "left_wrist_0_rgb": chw(arrays["wrist_image"])},
        "state": torch.from_numpy(arrays["state"]),
        "prompt": prompts,
    }
    return observation, arrays


def predict_libero_action_chunk(policy: PI0Policy, env_obs: Mapping[str, Any], prompt: str,
                                noise: np.ndarray | torch.Tensor | None = None) -> np.ndarray:
    """One raw LIBERO observation + prompt (+ (H, 32) flow noise) -> (H, 7) float64 env actions."""
    observation, _ = construct_pi0_observation(env_obs, prompt, policy.config.model.vision.image_size)
    if noise is not None:
        noise = torch.as_tensor(noise, dtype=torch.float32)[None]
    return policy.predict_action_chunk_with_info(observation, noise)["actions_f64"][0].numpy()


class Pi0ChunkPolicy:
    """Batched ``ChunkPolicy`` over a PI0Policy for LIBERO-format envs (LIBERO and the arena env).

    ``extras`` keep what RL needs to recompute the loss without re-rendering: the client images and
    state, the model-space state, the normalized action chunk and the flow noise.
    """

    def __init__(self, policy: PI0Policy, generator: torch.Generator | None = None):
        self.policy = policy
        self.generator = generator

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str]) -> PolicyOutput:
        """n raw observations -> PolicyOutput(actions (n, H, 7), extras)."""
        cfg = self.policy.config.model
        observation, arrays = construct_pi0_observation(obs, prompts, cfg.vision.image_size)
        noise = torch.randn(len(obs), cfg.action_horizon, cfg.action_dim, generator=self.generator)
        out = self.policy.predict_action_chunk_with_info(observation, noise)
        extras = {"image": arrays["image"], "wrist_image": arrays["wrist_image"], "state_raw": arrays["state"],
                  "state": out["state"].cpu().numpy(), "model_actions": out["model_actions"].cpu().numpy(),
                  "noise": out["noise"].cpu().numpy(), "tokenized_prompt": out["lang_tokens"].cpu().numpy(),
                  "tokenized_prompt_mask": out["lang_masks"].cpu().numpy()}
        return PolicyOutput(actions=out["actions_f64"].numpy(), extras=extras)
