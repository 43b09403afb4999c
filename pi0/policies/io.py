"""Policy-side observation handling shared by ``PI0Policy`` and ``PI0FASTPolicy`` (openpi's LiberoInputs rules).

Both policies take ``{"image": {key: (B,3,S,S) uint8}, "state": (B,S_raw), "prompt": [B str]}``; this mixin
validates it (every error says what is wrong and how to fix it) and turns the cameras into model images.
"""

from __future__ import annotations

from typing import Any

import torch

Observation = dict[str, Any]  # {"image": {key: (B,3,224,224) uint8}, "state": (B,S) float, "prompt": [str]}


class PolicyIO:
    """Mixin for a policy with ``config.image_keys``, ``config.model.vision.image_size`` and ``norm_stats``."""

    config: Any
    norm_stats: Any

    @property
    def state_dim(self) -> int:
        """Raw state width (from the norm stats)."""
        return self.norm_stats["state"].dim

    @property
    def action_dim(self) -> int:
        """Env action width (from the norm stats)."""
        return self.norm_stats["actions"].dim

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return next(self.parameters()).device  # type: ignore[attr-defined]

    def observation_inputs(self, observation: Observation
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[str]]:
        """Validate -> (images C x (B,3,S,S) in [-1,1], masks C x (B,) bool, raw state (B,S_raw), B prompts).

        A camera missing from the observation is a zero image with mask False. ``observation["image_mask"]``
        ({key: bool or (B,) bool}, optional) sets masks explicitly: an env's conventions decide them (openpi's
        LiberoInputs gives pi0-FAST's zero right-wrist image mask True; see ``pi0.policies.libero``).
        """
        if not isinstance(observation, dict) or "image" not in observation or "state" not in observation:
            raise ValueError("observation must be a dict with keys 'image', 'state' and 'prompt'")
        imgs = observation["image"]
        keys = self.config.image_keys
        unknown = sorted(set(imgs) - set(keys))
        if unknown:
            raise ValueError(f"unknown camera key(s) {unknown}; valid keys are {list(keys)}")
        if not any(k in imgs for k in keys):
            raise ValueError(f"observation has no image; give at least one of {list(keys)}")
        state = torch.as_tensor(observation["state"])
        if state.ndim != 2 or state.shape[1] != self.state_dim:
            raise ValueError(f"state must be (B, {self.state_dim}), got {tuple(state.shape)}")
        b = state.shape[0]
        prompts = observation.get("prompt")
        if prompts is None:
            raise ValueError("observation lacks 'prompt' (a list of B strings)")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if len(prompts) != b:
            raise ValueError(f"{len(prompts)} prompts for a batch of {b}")
        size, device = self.config.model.vision.image_size, self.device
        given_masks = observation.get("image_mask") or {}
        if not isinstance(given_masks, dict) or set(given_masks) - set(keys):
            raise ValueError(f"'image_mask' must be a dict over camera keys {list(keys)}, got {given_masks!r}")
        images, masks = [], []
        for key in keys:
            img = torch.as_tensor(imgs[key]) if key in imgs else torch.zeros(b, 3, size, size, dtype=torch.uint8)
            if img.dtype != torch.uint8 or tuple(img.shape) != (b, 3, size, size):
                raise ValueError(
                    f"image '{key}' must be uint8 (B, 3, {size}, {size}) with B={b}; got {img.dtype} "
                    f"{tuple(img.shape)} (resize with pi0.transforms.resize_with_pad, channels first)")
            images.append(img.to(device).float() / 255.0 * 2.0 - 1.0)
            mask = torch.as_tensor(given_masks.get(key, key in imgs), dtype=torch.bool).to(device)
            if mask.ndim > 1 or mask.numel() not in (1, b):
                raise ValueError(f"image_mask['{key}'] must be a bool or (B,) bools with B={b}, got {tuple(mask.shape)}")
            masks.append(mask.expand(b).clone())  # a bool or (1,) broadcasts to (B,)
        return images, masks, state, prompts
