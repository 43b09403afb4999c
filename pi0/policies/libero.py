"""openpi's LIBERO policy path for every model type: raw LIBERO observation -> policy -> 7-D env action chunk.

Client steps (``pi0.transforms``: rotate 180, resize_with_pad, 8-D state), then the camera layout of openpi's
``LiberoInputs`` (the one place it lives: :func:`libero_policy_observation`), then the policy's own transforms
(pi0: z-score, pad, tokenize; pi0-FAST: quantile, state bins in the prompt, greedy decoding, FAST extraction),
then unnormalize and delta -> absolute on the first 6 dims. ``Pi0ChunkPolicy`` adapts any policy to the rollout
engine's batched ``ChunkPolicy``; ``predict_libero_action_chunk`` answers one observation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pi0.policies.io import Observation
from pi0.rollout.types import PolicyOutput
from pi0.transforms import libero_client_batch

# as in openpi libero_policy.py LiberoInputs: agentview -> base_0_rgb, wrist camera -> left_wrist_0_rgb, and
# the right wrist (absent on LIBERO) is a zero image whose mask is False for pi0 / pi0.5 but TRUE for pi0-FAST
# (openpi does not mask padding images for pi0-FAST; with its decode-time attention window a False mask hides
# the agentview tokens from every decoded token).
CLIENT_CAMERAS: tuple[str, ...] = ("image", "wrist_image")  # client arrays, in the policy's camera order
PADDING_IMAGE_MASK: dict[str, bool] = {"pi0": False, "pi0fast": True}


def model_type_of_policy(policy: Any) -> str:
    """'pi0' or 'pi0fast' for a loaded policy (from its config; a config without the field is pi0)."""
    return getattr(policy.config, "model_type", "pi0")


def libero_policy_observation(client: Mapping[str, np.ndarray], prompts: Sequence[str],
                              image_keys: Sequence[str], model_type: str) -> Observation:
    """Client arrays (image / wrist_image (B,S,S,3) uint8, state (B,8)) + B prompts -> a policy observation.

    The policy's first camera is agentview, its second the wrist camera; any further camera is a zero image
    with mask ``PADDING_IMAGE_MASK[model_type]`` (as in openpi LiberoInputs).
    """
    if model_type not in PADDING_IMAGE_MASK:
        raise ValueError(f"no LIBERO camera convention for model type {model_type!r}; known: "
                         f"{list(PADDING_IMAGE_MASK)}")
    chw = lambda x: torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))  # noqa: E731
    images = {key: chw(client[src]) for key, src in zip(image_keys, CLIENT_CAMERAS)}
    masks: dict[str, bool] = {key: True for key in images}
    for key in image_keys[len(CLIENT_CAMERAS):]:
        images[key] = torch.zeros_like(images[image_keys[0]])
        masks[key] = PADDING_IMAGE_MASK[model_type]
    return {"image": images, "image_mask": masks, "state": torch.from_numpy(np.asarray(client["state"])),
            "prompt": list(prompts)}


def construct_libero_observation(env_obs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                                 prompt: str | Sequence[str], policy: Any
                                 ) -> tuple[Observation, dict[str, np.ndarray]]:
    """Raw LIBERO obs (one dict or a list of B) + prompt(s) -> (the policy's observation, client arrays).

    The client arrays are image/wrist_image (B,S,S,3) uint8 at the policy's image size and state (B,8) float64
    (float64 until normalized).
    """
    obs_list = [env_obs] if isinstance(env_obs, Mapping) else list(env_obs)
    prompts = [prompt] * len(obs_list) if isinstance(prompt, str) else list(prompt)
    if len(prompts) != len(obs_list):
        raise ValueError(f"{len(prompts)} prompts for {len(obs_list)} observations")
    size = policy.config.model.vision.image_size
    arrays = libero_client_batch(obs_list, size)
    observation = libero_policy_observation(arrays, prompts, policy.config.image_keys, model_type_of_policy(policy))
    return observation, arrays


def predict_libero_action_chunk(policy: Any, env_obs: Mapping[str, Any], prompt: str,
                                noise: np.ndarray | torch.Tensor | None = None, return_info: bool = False
                                ) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
    """One raw LIBERO observation + prompt -> (H, 7) float64 env actions, for any model type.

    ``noise`` (H, 32) fixes a flow policy's noise (pi0-FAST ignores it). ``return_info=True`` also returns the
    policy's ``predict_action_chunk_with_info`` dict (for pi0-FAST it holds ``output_tokens``, ``ok``, ``problems``).
    """
    observation, _ = construct_libero_observation(env_obs, prompt, policy)
    if noise is not None:
        noise = torch.as_tensor(noise, dtype=torch.float32)[None]
    info = policy.predict_action_chunk_with_info(observation, noise)
    actions = info["actions_f64"][0].numpy()
    return (actions, info) if return_info else actions


def window_extras(arrays: Mapping[str, np.ndarray], state: torch.Tensor, tokens: torch.Tensor,
                  token_mask: torch.Tensor) -> dict[str, np.ndarray]:
    """What an RL window needs of a decision without re-rendering: the client images and raw state (B,...),
    the model-space state (B,S), the tokenized prompt and its mask (B,L)."""
    return {"image": arrays["image"], "wrist_image": arrays["wrist_image"], "state_raw": arrays["state"],
            "state": state.cpu().numpy(), "tokenized_prompt": tokens.cpu().numpy(),
            "tokenized_prompt_mask": token_mask.cpu().numpy()}


def episode_noise(seed: int, key: Sequence[int], shape: tuple[int, ...]) -> torch.Tensor:
    """Standard-normal noise ``shape`` determined by ``seed`` and an episode key (task, init state, sample, decision):
    a function of the key alone, so paired evaluations of two policies draw the same noise per episode."""
    digest = hashlib.blake2b(repr((int(seed), *map(int, key))).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 1  # a 63-bit generator seed
    return torch.randn(*shape, generator=torch.Generator().manual_seed(h))


class Pi0ChunkPolicy:
    """Batched ``ChunkPolicy`` over any policy (pi0 or pi0-FAST) for LIBERO-format envs (LIBERO and the arena).

    Extras keep what RL needs to recompute the loss without re-rendering (the client images and state, the
    model-space state and the tokenized prompt) plus the model's own output: for a flow policy the normalized
    chunk and its noise, for pi0-FAST the decoded tokens and the per-sample ``ok`` of the action decoding.
    """

    def __init__(self, policy: Any, generator: torch.Generator | None = None, episode_seed: int | None = None):
        """``episode_seed``: a flow policy draws each row's initial noise from (seed, task, init state, sample,
        decision index) instead of ``generator`` (the runner passes the keys), so an episode's noise does not depend
        on which other episodes share its batch: two policies evaluated on the same states see the same noise."""
        self.policy = policy
        self.generator = generator
        self.episode_seed = episode_seed

    @property
    def keyed(self) -> bool:
        """Whether the runner should pass each row's episode key (see ``episode_noise``)."""
        return self.episode_seed is not None and model_type_of_policy(self.policy) != "pi0fast"

    def predict_chunks(self, obs: list[dict[str, np.ndarray]], prompts: list[str],
                       keys: Sequence[tuple[int, ...]] | None = None) -> PolicyOutput:
        """n raw observations (+ their episode keys when ``keyed``) -> PolicyOutput(actions (n, H, 7) float64,
        extras)."""
        observation, arrays = construct_libero_observation(obs, prompts, self.policy)
        if model_type_of_policy(self.policy) == "pi0fast":
            out = self.policy.predict_action_chunk_with_info(observation, generator=self.generator)
            own = {"output_tokens": out["output_tokens"].cpu().numpy(), "ok": out["ok"]}
        else:
            cfg = self.policy.config.model
            shape = (cfg.action_horizon, cfg.action_dim)
            if self.episode_seed is not None and keys is not None:
                noise = torch.stack([episode_noise(self.episode_seed, k, shape) for k in keys])
            else:
                noise = torch.randn(len(obs), *shape, generator=self.generator)
            out = self.policy.predict_action_chunk_with_info(observation, noise)
            own = {"model_actions": out["model_actions"].cpu().numpy(), "noise": out["noise"].cpu().numpy()}
        extras = {**window_extras(arrays, out["state"], out["lang_tokens"], out["lang_masks"]), **own}
        return PolicyOutput(actions=out["actions_f64"].numpy(), extras=extras)
