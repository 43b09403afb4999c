"""``PI0Policy``: pi0 with openpi's policy I/O (normalization, tokenization, cameras, action queue, persistence).

Directory format: ``model.safetensors`` + ``config.json`` + ``norm_stats.json`` + ``tokenizer.model``.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pi0.errors import UserError
from pi0.models.config import CAMERA_KEYS, Pi0Config, config_from_dict
from pi0.models.fast_sampler import FastSampler
from pi0.models.init import check_init_mode, scratch_init_
from pi0.models.pi0 import PI0Model
from pi0.policies.base import PretrainedPolicy
from pi0.policies.io import Observation, PolicyIO
from pi0.policies.normalize import MODES, discretize_state, NormStats, Stats, normalize, unnormalize
from pi0.policies.tokenizer import PaligemmaTokenizer


@dataclass
class PolicyConfig:
    """Everything ``PI0Policy`` needs besides weights, norm stats and the tokenizer (this is config.json)."""

    model: Pi0Config = field(default_factory=Pi0Config)
    n_action_steps: int = 5  # actions executed from each chunk before replanning (openpi LIBERO: 5)
    num_steps: int = 10  # Euler steps
    normalization: str = "zscore"  # pi0 uses z-score; "quantile" is available (pi0-FAST / pi05 style)
    # Leading action dims predicted as deltas w.r.t. the raw state (openpi pi0_libero: 6).
    delta_action_dims: int = 0
    image_keys: tuple[str, ...] = CAMERA_KEYS
    # CFG-style RL: guidance weight w used when the model has the optimality condition (0 = reference
    # policy, 1 = conditioned policy, >1 = guided further; see PI0Model.guided_velocity_fn).
    cfg_guidance: float = 1.0
    # pi0.5's discrete-state prompt ("Task: ..., State: <256 bins>;\nAction: "). openpi defaults it to pi05 and its
    # pi05_libero turns it off; here it is off unless set (the converter sets it from --openpi_config).
    discrete_state_input: bool = False

    def __post_init__(self) -> None:
        if self.normalization not in MODES:
            raise ValueError(f"normalization must be one of {MODES}, got {self.normalization!r}")
        if not 1 <= self.n_action_steps <= self.model.action_horizon:
            raise ValueError(f"n_action_steps must be in [1, {self.model.action_horizon}], got {self.n_action_steps}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if len(self.image_keys) != self.model.num_cameras:
            raise ValueError(f"{len(self.image_keys)} image_keys for num_cameras={self.model.num_cameras}")
        self.image_keys = tuple(self.image_keys)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (config.json)."""
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        d["image_keys"] = list(self.image_keys)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PolicyConfig":
        """Inverse of ``to_dict``; unknown keys raise ValueError naming them."""
        return config_from_dict(cls, data, {"model": Pi0Config})


class PI0Policy(PretrainedPolicy, PolicyIO, nn.Module):
    """pi0 with openpi's policy I/O: normalization, tokenization, cameras, action chunking."""

    MODEL_TYPE = "pi0"
    config_class, model_config_class, model_class = PolicyConfig, Pi0Config, PI0Model

    def __init__(self, config: PolicyConfig, norm_stats: NormStats, tokenizer: PaligemmaTokenizer,
                 model: PI0Model | None = None):
        super().__init__()
        self.config = config
        self.norm_stats = norm_stats
        self.tokenizer = tokenizer
        self.model = model if model is not None else PI0Model(config.model)
        if tokenizer.max_len != config.model.max_token_len:
            raise ValueError(f"tokenizer max_len {tokenizer.max_len} != model max_token_len "
                             f"{config.model.max_token_len}")
        for key in ("state", "actions"):
            if key not in norm_stats:
                raise ValueError(f"norm stats lack '{key}'")
            if norm_stats[key].dim > config.model.action_dim:
                raise ValueError(f"norm stats '{key}' have {norm_stats[key].dim} dims > model action_dim "
                                 f"{config.model.action_dim}")
        if tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces > model vocab {config.model.vocab_size}")
        self._queue: collections.deque[torch.Tensor] = collections.deque()

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, observation: Observation) -> dict[str, Any]:
        """Validate an observation and build model inputs (images in [-1,1], masks, tokens, padded normalized state)."""
        images, masks, state, prompts = self.observation_inputs(observation)
        device = self.device
        norm_state = normalize(state, self.norm_stats["state"], self.config.normalization)
        bins = discretize_state(norm_state.cpu().numpy()).tolist() if self.config.discrete_state_input else None
        tokens, tok_mask = self.tokenizer(prompts, bins)
        padded = F.pad(norm_state, (0, self.config.model.action_dim - self.state_dim)).to(torch.float32)
        return dict(images=images, img_masks=masks, lang_tokens=tokens.to(device), lang_masks=tok_mask.to(device),
                    state=padded.to(device), raw_state=state)

    def postprocess_actions(self, actions: torch.Tensor, model_state: torch.Tensor) -> torch.Tensor:
        """Model-space chunk (B,H,32) + model-space state (B,32) -> env actions (B,H,action_dim) float64.

        as in openpi's output transforms: Unnormalize, then (pi0_libero) AbsoluteActions adds the
        round-tripped state to the first ``delta_action_dims`` dims, then keep ``action_dim`` dims.
        """
        mode = self.config.normalization
        acts = unnormalize(actions.cpu(), self.norm_stats["actions"], mode)
        d = self.config.delta_action_dims
        if d:
            state_rt = unnormalize(model_state.cpu(), self.norm_stats["state"], mode)  # (B, 32)
            acts[..., :d] += state_rt[:, None, :d]
        return acts[..., : self.action_dim]

    # ------------------------------------------------------------------ acting
    @torch.no_grad()
    def predict_action_chunk(self, observation: Observation, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Observation -> unnormalized env action chunk (B, H, action_dim); ``noise`` (B,H,32) fixes the flow noise."""
        return self.predict_action_chunk_with_info(observation, noise)["actions"]

    @torch.no_grad()
    def predict_action_chunk_with_info(self, observation: Observation, noise: torch.Tensor | None = None
                                       ) -> dict[str, torch.Tensor]:
        """Like ``predict_action_chunk`` but also returns model inputs, noise and the normalized chunk."""
        inp = self.prepare_inputs(observation)
        b = inp["state"].shape[0]
        shape = (b, self.config.model.action_horizon, self.config.model.action_dim)
        if noise is None:
            noise = torch.randn(shape, device=self.device)
        noise = torch.as_tensor(noise, dtype=torch.float32).to(self.device)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise must be {shape}, got {tuple(noise.shape)}")
        was_training = self.model.training
        self.model.eval()
        guidance = self.config.cfg_guidance if self.config.model.optimality_condition else None
        model_actions = self.model.sample_actions(inp["images"], inp["img_masks"], inp["lang_tokens"],
                                                  inp["lang_masks"], inp["state"], noise, self.config.num_steps,
                                                  guidance=guidance)
        self.model.train(was_training)
        actions = self.postprocess_actions(model_actions, inp["state"])
        return dict(actions=actions.to(torch.float32), actions_f64=actions, model_actions=model_actions,
                    noise=noise, state=inp["state"], lang_tokens=inp["lang_tokens"], lang_masks=inp["lang_masks"])

    def enable_fast_sampling(self, enabled: bool = True, **options: Any) -> FastSampler | None:
        """Predict chunks with ``pi0.models.fast_sampler.FastSampler`` (same numbers; see PI0Model.enable_fast_sampling)."""
        return self.model.enable_fast_sampling(enabled, **options)

    def reset(self) -> None:
        """Clear the action queue (call at every episode start)."""
        self._queue.clear()

    @torch.no_grad()
    def select_action(self, observation: Observation) -> torch.Tensor:
        """Next env action (B, action_dim); a new chunk is predicted every ``n_action_steps`` calls."""
        if not self._queue:
            chunk = self.predict_action_chunk(observation)  # (B, H, A)
            self._queue.extend(chunk[:, : self.config.n_action_steps].transpose(0, 1))
        return self._queue.popleft()

    # ------------------------------------------------------------------ persistence
    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        openpi_bf16_params: bool = False, **overrides: Any) -> "PI0Policy":
        """Our directory (``PretrainedPolicy.from_pretrained``), or an openpi-PyTorch / RLinf / LeRobot one, told
        apart by its files (``pi0.conversion.openpi_pytorch``); those also take ``norm_stats``, ``tokenizer`` and
        ``openpi_config``; ``delta_action_dims`` and the other ``PolicyConfig`` overrides apply to both."""
        from pi0.conversion.foreign_files import is_our_policy_dir
        from pi0.conversion.openpi_pytorch import load_foreign_policy

        if is_our_policy_dir(directory):
            foreign = sorted(k for k in ("norm_stats", "tokenizer", "openpi_config") if overrides.get(k) is not None)
            if foreign:
                raise UserError(f"{foreign} apply only to openpi-PyTorch / RLinf / LeRobot directories; {directory} "
                                f"is in our format (its config.json, norm_stats.json and tokenizer.model decide)")
            overrides = {k: v for k, v in overrides.items() if k not in ("norm_stats", "tokenizer", "openpi_config")}
            return super().from_pretrained(directory, device=device, openpi_bf16_params=openpi_bf16_params,
                                           **overrides)
        return load_foreign_policy(directory, device=device, openpi_bf16_params=openpi_bf16_params, **overrides)

    def save_pretrained(self, directory: str | Path, dtype: str | None = None,
                        state: dict[str, torch.Tensor] | None = None, format: str = "ours",
                        asset_id: str = "physical-intelligence/libero") -> Path:
        """Our directory (``format="ours"``, see ``PretrainedPolicy.save_pretrained``) or openpi's PyTorch format
        (``format="openpi-pytorch"``: openpi's keys, shapes and dtypes, norm stats in ``assets/<asset_id>/``)."""
        if format == "openpi-pytorch":
            from pi0.conversion.openpi_pytorch import save_openpi_pytorch

            return save_openpi_pytorch(self, directory, dtype=dtype, state=state, asset_id=asset_id)
        if format != "ours":
            raise UserError(f"format must be 'ours' or 'openpi-pytorch', got {format!r}")
        return super().save_pretrained(directory, dtype=dtype, state=state)

    @classmethod
    def random_init(cls, config: PolicyConfig, norm_stats: NormStats, tokenizer: PaligemmaTokenizer,
                    seed: int = 0, std: float = 0.02, init: str = "noisy") -> "PI0Policy":
        """A randomly initialised policy.

        ``init="noisy"`` (the embedded default / parity tests): N(0, std) weights and noisy norms, so every
        parameter matters numerically. ``init="scratch"``: an initialisation to *train* from (see
        :func:`scratch_init_`). Built on meta and allocated once in the final dtypes; each tensor is drawn in
        float32 (tensors over 2**22 elements in 2**22-element slices) and cast in place, so a bf16 config never
        holds a float32 model.
        """
        check_init_mode(init)
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            model = PI0Model(config.model)
        model.to_empty(device="cpu")
        if init == "scratch":
            scratch_init_(model, gen)
            return cls(config, norm_stats, tokenizer, model).eval()
        chunk = 1 << 22
        with torch.no_grad():
            for p in model.parameters():
                scale = std if p.ndim > 1 else 0.1
                if p.numel() <= chunk:
                    p.copy_(torch.randn(p.shape, generator=gen).mul_(scale))
                    continue
                flat = p.view(-1)
                for i in range(0, flat.numel(), chunk):
                    n = min(chunk, flat.numel() - i)
                    flat[i:i + n].copy_(torch.randn(n, generator=gen).mul_(scale))
        return cls(config, norm_stats, tokenizer, model).eval()


def default_norm_stats(state_dim: int = 8, action_dim: int = 7) -> NormStats:
    """Identity-like norm stats (mean 0, std 1, quantiles +-1) for random-init demos."""
    z, o = np.zeros(state_dim), np.ones(state_dim)
    za, oa = np.zeros(action_dim), np.ones(action_dim)
    return {"state": Stats(z, o, -o, o), "actions": Stats(za, oa, -oa, oa)}
