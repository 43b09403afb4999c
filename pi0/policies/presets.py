"""The embedded defaults: tiny random pi0 / pi0-FAST policies with an offline-built tokenizer (no download, ~1 s)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pi0.models.config import Pi0Config
from pi0.models.pi0fast import Pi0FASTConfig
from pi0.policies.io import Observation
from pi0.policies.pi0fast import FASTPolicyConfig, PI0FASTPolicy
from pi0.policies.pi0 import PI0Policy, PolicyConfig, default_norm_stats
from pi0.policies.tokenizer import PaligemmaTokenizer, build_tokenizer_model


def default_cache_dir() -> Path:
    """Where generated artefacts (the tiny tokenizer) are cached: $PI0_CACHE or <tmp>/pi0_cache."""
    return Path(os.environ.get("PI0_CACHE", Path(tempfile.gettempdir()) / "pi0_cache"))


def tiny_tokenizer(max_len: int = 48, cache_dir: Path | None = None) -> PaligemmaTokenizer:
    """The offline sentencepiece stand-in for PaliGemma's tokenizer (built once, then cached)."""
    path = (cache_dir or default_cache_dir()) / "tiny_tokenizer.model"
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        build_tokenizer_model(tmp)
        tmp.replace(path)  # atomic: concurrent processes never read a half-written model
    return PaligemmaTokenizer(path, max_len)


def tiny_policy(seed: int = 0, delta_action_dims: int = 6, state_dim: int = 8, action_dim: int = 7,
                dtype: str = "float32", pi05: bool = False, **policy_overrides) -> PI0Policy:
    """A tiny random pi0 (or pi0.5: ``pi05=True``) (Gemma 'dummy' x2, SigLIP mu/14) in LIBERO's I/O format
    (8-D state, 7-D actions)."""
    cfg = PolicyConfig(model=Pi0Config.tiny(dtype=dtype, pi05=pi05), delta_action_dims=delta_action_dims,
                       **policy_overrides)
    return PI0Policy.random_init(cfg, default_norm_stats(state_dim, action_dim), tiny_tokenizer(), seed=seed)


def tiny_fast_policy(seed: int = 0, delta_action_dims: int = 6, state_dim: int = 8, action_dim: int = 7,
                     **model_overrides: Any) -> PI0FASTPolicy:
    """The embedded tiny pi0-FAST (Gemma dummy depth 2, SigLIP mu/14, vocab 1024) in LIBERO's I/O format."""
    # best-effort decoding: the stand-in text tokenizer has no pieces for the action ids (see PI0FASTPolicy)
    cfg = FASTPolicyConfig(model=Pi0FASTConfig.tiny(action_dim=action_dim, **model_overrides),
                           delta_action_dims=delta_action_dims, action_decoding="best_effort")
    return PI0FASTPolicy.random_init(cfg, default_norm_stats(state_dim, action_dim), tiny_tokenizer(), seed=seed)


def synthetic_observation(policy: PI0Policy | PI0FASTPolicy, batch_size: int = 1, seed: int = 0,
                          prompt: str = "pick up the black bowl and place it on the plate") -> Observation:
    """A deterministic observation in PI0Policy's format (two cameras, random state)."""
    g = np.random.default_rng(seed)
    size = policy.config.model.vision.image_size
    imgs = {k: torch.from_numpy(g.integers(0, 256, (batch_size, 3, size, size), dtype=np.uint8))
            for k in policy.config.image_keys[:2]}
    state = torch.from_numpy(g.normal(size=(batch_size, policy.state_dim)).astype(np.float32))
    return {"image": imgs, "state": state, "prompt": [prompt] * batch_size}
