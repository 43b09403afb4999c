"""Policy loading by model type: ``load_policy(dir)`` reads config.json's ``model_type`` and builds the right class.

pi0 directories written before ``model_type`` existed have none and load as pi0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

MODEL_TYPES = ("pi0", "pi0fast")


def model_type_of(directory: str | Path) -> str:
    """'pi0' or 'pi0fast' from <directory>/config.json (missing field = 'pi0'); clear errors otherwise."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a policy directory written by save_pretrained or "
                                f"convert_pi0_to_hf_lerobot.py")
    try:
        kind = json.loads(path.read_text()).get("model_type", "pi0")
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if kind not in MODEL_TYPES:
        raise ValueError(f"{path}: unknown model_type {kind!r}; known: {list(MODEL_TYPES)}")
    return kind


def load_policy(directory: str | Path, device: str = "cpu", **overrides: Any) -> nn.Module:
    """A ``PI0Policy`` or ``PI0FASTPolicy`` from its directory (dispatch on config.json's model_type)."""
    if model_type_of(directory) == "pi0fast":
        from pi0.policy_pi0fast import PI0FASTPolicy

        return PI0FASTPolicy.from_pretrained(directory, device=device, **overrides)
    from pi0.modeling_pi0 import PI0Policy

    return PI0Policy.from_pretrained(directory, device=device, **overrides)


def tiny_fast_policy(seed: int = 0, delta_action_dims: int = 6, state_dim: int = 8, action_dim: int = 7,
                     **model_overrides: Any):
    """The embedded tiny pi0-FAST (Gemma dummy depth 2, SigLIP mu/14, vocab 1024) in LIBERO's I/O format."""
    from pi0.modeling_pi0 import default_norm_stats
    from pi0.modeling_pi0fast import Pi0FASTConfig
    from pi0.policy_pi0fast import FASTPolicyConfig, PI0FASTPolicy
    from pi0.presets import tiny_tokenizer

    cfg = FASTPolicyConfig(model=Pi0FASTConfig.tiny(action_dim=action_dim, **model_overrides),
                           delta_action_dims=delta_action_dims)
    return PI0FASTPolicy.random_init(cfg, default_norm_stats(state_dim, action_dim), tiny_tokenizer(), seed=seed)


class PolicyChunkAdapter:
    """Batched ``ChunkPolicy`` (rollout engine protocol) over a ``PI0Policy`` or ``PI0FASTPolicy``.

    Raw LIBERO-format observations (LIBERO or the arena) go through openpi's client steps
    (``pi0.transforms.libero_client_obs``: rotate 180, resize_with_pad to the policy's image size, 8-D state);
    agentview -> the policy's first camera, wrist -> its second (if it has one). Extras: the client state and,
    for pi0-FAST, the decoded tokens and the per-sample ``ok`` flag of the action decoding.
    """

    def __init__(self, policy: nn.Module, generator: Any = None):
        self.policy = policy
        self.generator = generator

    def predict_chunks(self, obs: list[dict[str, Any]], prompts: list[str]):
        """n raw observations + prompts -> PolicyOutput(actions (n, H, A) float64, extras)."""
        import numpy as np
        import torch

        from pi0.rollout.types import PolicyOutput
        from pi0.transforms import libero_client_obs

        size = self.policy.config.model.vision.image_size
        client = [libero_client_obs(o, size) for o in obs]
        chw = lambda k: torch.from_numpy(np.stack([c[k] for c in client]).transpose(0, 3, 1, 2).copy())  # noqa: E731
        keys = self.policy.config.image_keys
        images = {keys[0]: chw("image")} | ({keys[1]: chw("wrist_image")} if len(keys) > 1 else {})
        state = np.stack([c["state"] for c in client])
        observation = {"image": images, "state": torch.from_numpy(state), "prompt": list(prompts)}
        if hasattr(self.policy, "fast_tokenizer"):
            out = self.policy.predict_action_chunk_with_info(observation, generator=self.generator)
            extras = {"state_raw": state, "output_tokens": out["output_tokens"].cpu().numpy(), "ok": out["ok"]}
        else:
            out = self.policy.predict_action_chunk_with_info(observation)
            extras = {"state_raw": state, "noise": out["noise"].cpu().numpy()}
        return PolicyOutput(actions=out["actions_f64"].numpy(), extras=extras)
