"""pi0: PaliGemma VLM + Gemma action expert trained by flow matching (PyTorch port of openpi's pi0.py).

``PI0Model`` is the network with openpi's model-level API (``sample_actions`` / ``forward``).
``PI0Policy`` wraps it with normalization, tokenization, camera handling, an action queue and
``save_pretrained`` / ``from_pretrained`` (``model.safetensors`` + ``config.json`` + ``norm_stats.json``
+ ``tokenizer.model``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pi0 import checkpoint_io
from pi0.attention import make_attn_mask, make_positions
from pi0.config import CAMERA_KEYS, Pi0Config, config_from_dict
from pi0.fast_sampler import FastSampler
from pi0.flow import cfg_combine, euler_integrate, flow_matching_pair, posemb_sincos, sample_time
from pi0.init import check_init_mode, scratch_init_
from pi0.normalize import MODES, NormStats, Stats, load_norm_stats, normalize, save_norm_stats, unnormalize
from pi0.paligemma_with_expert import KVCache, PaliGemmaWithExpert
from pi0.policy_io import Observation, PolicyIO
from pi0.tokenizer import PaligemmaTokenizer

# Parameters kept in float32 under openpi's bf16 mixed precision: norms, patch and position embeddings,
# and pi0's own small projections (openpi's nnx.Linear heads have no bf16 dtype, so they compute in float32).
_FP32_PARAM_MARKERS = ("layernorm", "layer_norm", ".norm.", "patch_embedding", "position_embedding")
_FP32_HEADS = ("state_proj.", "action_in_proj.", "action_out_proj.", "action_time_mlp_in.", "action_time_mlp_out.",
               "optimality_embedding")


def _is_fp32_param(name: str) -> bool:
    """True for parameters that stay float32 in bfloat16 mode."""
    name = name.removeprefix("model.")
    return (any(m in name for m in _FP32_PARAM_MARKERS) or name.endswith(".norm.weight")
            or name.startswith(_FP32_HEADS))


def param_storage_dtype(name: str, dtype: str) -> torch.dtype:
    """Storage dtype of parameter ``name`` under precision ``dtype`` ("float32" or openpi's "bfloat16" mix)."""
    return torch.float32 if dtype == "float32" or _is_fp32_param(name) else torch.bfloat16


class PI0Model(nn.Module):
    """The pi0 network: prefix (images + language) through PaliGemma, suffix (state + actions) through the expert."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.cfg = cfg
        w = cfg.action_expert.width
        self.paligemma_with_expert = PaliGemmaWithExpert(cfg)
        self.state_proj = nn.Linear(cfg.action_dim, w)
        self.action_in_proj = nn.Linear(cfg.action_dim, w)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)
        self.action_out_proj = nn.Linear(w, cfg.action_dim)
        self.fast_sampler: FastSampler | None = None  # see enable_fast_sampling
        if cfg.optimality_condition:
            self.optimality_embedding = nn.Parameter(torch.zeros(w))
        self.apply_precision()

    def enable_optimality_condition(self) -> "PI0Model":
        """Add the zero-initialised optimality embedding (W,) (CFG-style RL); outputs are unchanged until trained."""
        if not self.cfg.optimality_condition:
            self.cfg = dataclasses.replace(self.cfg, optimality_condition=True)
            ref = self.state_proj.weight
            self.optimality_embedding = nn.Parameter(torch.zeros(ref.shape[0], dtype=torch.float32, device=ref.device))
        return self

    # ------------------------------------------------------------------ precision
    def apply_precision(self) -> "PI0Model":
        """Cast parameters for ``cfg.dtype``: all float32, or bf16 except norms / patch / position embeddings."""
        if self.cfg.dtype == "float32":
            return self.float()
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if _is_fp32_param(name) else torch.bfloat16)
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activation dtype."""
        return self.paligemma_with_expert.compute_dtype

    @torch.no_grad()
    def round_params_(self, dtype: torch.dtype = torch.bfloat16) -> "PI0Model":
        """Round every weight through ``dtype`` in place, keeping its storage dtype.

        Unmodified openpi serving (create_trained_policy -> restore_params(dtype=bfloat16)) runs a float32
        model on bf16-rounded weights; this reproduces those numbers exactly.
        """
        for p in self.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
        return self

    def _linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """Apply ``layer`` after casting x to its weight dtype."""
        return layer(x.to(layer.weight.dtype))

    # ------------------------------------------------------------------ embeddings
    def embed_prefix(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                     lang_masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Images C x (B,3,224,224), masks C x (B,), tokens/masks (B,L) -> embs (B,Tp,D), pad (B,Tp), ar (Tp,).

        as in openpi pi0.py embed_prefix: image tokens per camera (not scaled), then language tokens
        (scaled by sqrt(D)); every prefix token has ar=False (one bidirectional block).
        """
        pwe = self.paligemma_with_expert
        embs, pads = [], []
        for img, m in zip(images, img_masks):
            if not bool(m.any()):
                # A camera masked in every sample contributes nothing: its keys are masked out and it does
                # not advance positions, so skipping it is exact (and saves a SigLIP pass + 256 tokens).
                continue
            tok = pwe.embed_image(img)  # (B, P, D)
            embs.append(tok)
            pads.append(m.bool()[:, None].expand(-1, tok.shape[1]))
        embs.append(pwe.embed_language(lang_tokens))
        pads.append(lang_masks.bool())
        emb, pad = torch.cat(embs, 1), torch.cat(pads, 1)
        ar = torch.zeros(emb.shape[1], dtype=torch.bool, device=emb.device)
        return emb, pad, ar

    def embed_suffix(self, state: torch.Tensor, noisy_actions: torch.Tensor, time: torch.Tensor,
                     condition: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """state (B,S), x_t (B,H,A), t (B,), condition (B,) in {0,1} -> embs (B,1+H,W), pad (B,1+H), ar (1+H,).

        as in openpi pi0.py embed_suffix: one state token, then H action tokens made of
        action_in_proj(x_t) ++ posemb(t) -> mlp_in -> swish -> mlp_out. ar = [True, True, False...]:
        the state token and the action block each start a new block. With ``cfg.optimality_condition``
        (after CFGRL, Frans et al. 2025) ``condition * optimality_embedding`` is added to the state token;
        ``condition=None`` means unconditioned (0).
        """
        b, h, _ = noisy_actions.shape
        state_tok = self._linear(self.state_proj, state)[:, None]  # (B, 1, W)
        if condition is not None and self.cfg.optimality_condition:
            cond = condition.to(state_tok.dtype)[:, None, None]  # (B, 1, 1)
            state_tok = state_tok + cond * self.optimality_embedding.to(state_tok.dtype)
        act = self._linear(self.action_in_proj, noisy_actions)  # (B, H, W)
        t_emb = posemb_sincos(time, act.shape[-1]).to(act.dtype)[:, None].expand(-1, h, -1)  # (B, H, W)
        x = self._linear(self.action_time_mlp_in, torch.cat([act, t_emb], -1))
        x = self._linear(self.action_time_mlp_out, F.silu(x))
        emb = torch.cat([state_tok, x], 1).to(self.compute_dtype)
        pad = torch.ones(b, 1 + h, dtype=torch.bool, device=emb.device)
        ar = torch.zeros(1 + h, dtype=torch.bool, device=emb.device)
        ar[:2] = True
        return emb, pad, ar

    def _velocity(self, suffix_out: torch.Tensor) -> torch.Tensor:
        """(B, 1+H, W) expert output -> (B, H, A) float32 velocity."""
        h = self.cfg.action_horizon
        return self._linear(self.action_out_proj, suffix_out[:, -h:]).to(torch.float32)

    # ------------------------------------------------------------------ training loss
    def forward(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                lang_masks: torch.Tensor, state: torch.Tensor, actions: torch.Tensor,
                noise: torch.Tensor | None = None, time: torch.Tensor | None = None,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        """Per-element flow-matching loss (B, H, A) = (v_theta(x_t, t | condition (B,)) - (noise - actions))^2.

        as in openpi pi0.py compute_loss (without the final mean over action dims).
        """
        b = actions.shape[0]
        if noise is None:
            noise = torch.randn_like(actions, dtype=torch.float32)
        if time is None:
            time = sample_time(b, device=actions.device)
        x_t, u_t = flow_matching_pair(actions.float(), noise.float(), time.float())
        v_t = self.predict_velocity(images, img_masks, lang_tokens, lang_masks, state, x_t, time, condition)
        return (v_t - u_t) ** 2

    def predict_velocity(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                         lang_masks: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor, time: torch.Tensor,
                         condition: torch.Tensor | None = None) -> torch.Tensor:
        """v_theta(x_t, t | condition (B,)) (B, H, A) from one joint pass over prefix + suffix (training path)."""
        p_emb, p_pad, p_ar = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        s_emb, s_pad, s_ar = self.embed_suffix(state, x_t, time, condition)
        pad = torch.cat([p_pad, s_pad], 1)
        mask = make_attn_mask(pad, torch.cat([p_ar, s_ar]))
        (_, s_out), _ = self.paligemma_with_expert([p_emb, s_emb], mask, make_positions(pad))
        return self._velocity(s_out)

    # ------------------------------------------------------------------ inference
    def encode_prefix(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                      lang_masks: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
        """Run the prefix once -> (per-layer kv cache (B,Tp,K,H) after RoPE, prefix pad mask (B,Tp))."""
        emb, pad, ar = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        _, cache = self.paligemma_with_expert([emb, None], make_attn_mask(pad, ar), make_positions(pad),
                                              return_kv_cache=True)
        assert cache is not None
        return cache, pad

    def denoise_step(self, kv_cache: KVCache, prefix_pad: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor,
                     time: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        """One velocity evaluation on a cached prefix: x_t (B,H,A), t (B,), condition (B,) -> v_t (B,H,A).

        as in openpi pi0.py sample_actions step(): suffix queries see every valid prefix key plus
        the suffix block mask; suffix positions continue from sum(prefix_mask).
        """
        s_emb, s_pad, s_ar = self.embed_suffix(state, x_t, time, condition)
        t_s = s_emb.shape[1]
        prefix_part = prefix_pad[:, None, :].expand(-1, t_s, -1)  # (B, Ts, Tp)
        mask = torch.cat([prefix_part, make_attn_mask(s_pad, s_ar)], -1)  # (B, Ts, Tp + Ts)
        positions = make_positions(s_pad, offset=prefix_pad.sum(-1))
        (_, s_out), _ = self.paligemma_with_expert([None, s_emb], mask, positions, kv_cache=kv_cache)
        return self._velocity(s_out)

    @torch.no_grad()
    def sample_actions(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                       lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor | None = None,
                       num_steps: int = 10, guidance: float | None = None) -> torch.Tensor:
        """Denoise from ``noise`` (B,H,A) (default N(0,1)) with ``num_steps`` Euler steps -> actions (B,H,A).

        The prefix runs once; its per-layer keys/values are reused by every Euler step. ``guidance`` w (needs
        ``cfg.optimality_condition``): v = v_uncond + w (v_cond - v_uncond); None = unconditioned.
        """
        if self.fast_sampler is not None and guidance is None:  # same numbers, fewer FLOPs (test_fast_sampler.py)
            return self.fast_sampler.sample_actions(images, img_masks, lang_tokens, lang_masks, state, noise, num_steps)
        b = state.shape[0]
        if noise is None:
            noise = torch.randn(b, self.cfg.action_horizon, self.cfg.action_dim, device=state.device)
        kv_cache, prefix_pad = self.encode_prefix(images, img_masks, lang_tokens, lang_masks)
        if guidance is None:
            velocity = lambda x, t: self.denoise_step(kv_cache, prefix_pad, state, x, t)  # noqa: E731
        else:
            velocity = self.guided_velocity_fn(kv_cache, prefix_pad, state, float(guidance))
        return euler_integrate(velocity, noise.float(), num_steps)

    def guided_velocity_fn(self, kv_cache: KVCache, prefix_pad: torch.Tensor, state: torch.Tensor, w: float
                           ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(x_t (B,H,A), t (B,)) -> guided velocity (B,H,A) on a shared prefix cache (CFG-style RL).

        as in CFGRL (Frans et al. 2025): v = v_u + w (v_c - v_u). w=0 and w=1 need one pass (uncond / cond);
        otherwise both branches run in ONE batched pass with the prefix cache repeated along the batch.
        """
        if not self.cfg.optimality_condition:
            raise ValueError("guided sampling needs a model with optimality_condition=True "
                             "(enable it with PI0Model.enable_optimality_condition() and train it)")
        b = state.shape[0]
        if w in (0.0, 1.0):
            cond = torch.full((b,), w, device=state.device)
            return lambda x, t: self.denoise_step(kv_cache, prefix_pad, state, x, t, cond)
        cache2 = [(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in kv_cache]
        pad2, state2 = prefix_pad.repeat(2, 1), state.repeat(2, 1)
        cond2 = torch.cat([torch.zeros(b, device=state.device), torch.ones(b, device=state.device)])

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            v = self.denoise_step(cache2, pad2, state2, x.repeat(2, 1, 1), t.repeat(2), cond2)
            return cfg_combine(v[:b], v[b:], w)
        return velocity

    def enable_fast_sampling(self, enabled: bool = True, **options: Any) -> FastSampler | None:
        """Route ``sample_actions`` through ``pi0.fast_sampler.FastSampler(self, **options)`` (e.g. compile=True,
        cuda_graph=None: auto on CUDA); ``enabled=False`` restores the eager reference path."""
        self.fast_sampler = FastSampler(self, **options) if enabled else None
        return self.fast_sampler

    @torch.no_grad()
    def sample_actions_uncached(self, images: list[torch.Tensor], img_masks: list[torch.Tensor],
                                lang_tokens: torch.Tensor, lang_masks: torch.Tensor, state: torch.Tensor,
                                noise: torch.Tensor, num_steps: int = 10) -> torch.Tensor:
        """Same as ``sample_actions`` but recomputes the prefix at every step (baseline for bench/sampling.py)."""
        return euler_integrate(
            lambda x, t: self.predict_velocity(images, img_masks, lang_tokens, lang_masks, state, x, t),
            noise.float(), num_steps)


# ====================================================================== policy
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


class PI0Policy(PolicyIO, nn.Module):
    """pi0 with openpi's policy I/O: normalization, tokenization, cameras, action chunking."""

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
        tokens, tok_mask = self.tokenizer(prompts)
        norm_state = normalize(state, self.norm_stats["state"], self.config.normalization)
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
        """Predict chunks with ``pi0.fast_sampler.FastSampler`` (same numbers; see PI0Model.enable_fast_sampling)."""
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
    def save_pretrained(self, directory: str | Path, dtype: str | None = None) -> Path:
        """Write model.safetensors, config.json, norm_stats.json and tokenizer.model into ``directory``.

        Tensors are cast and written one at a time (no second copy of the model in memory).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = self.config
        if dtype is not None and dtype != cfg.model.dtype:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
        state = self.model.state_dict()
        specs = {f"model.{k}": (param_storage_dtype(k, cfg.model.dtype), tuple(t.shape)) for k, t in state.items()}
        with checkpoint_io.SafetensorsWriter(directory / "model.safetensors", specs) as writer:
            for k, t in state.items():
                writer.write(f"model.{k}", t.detach().to(specs[f"model.{k}"][0]))
        (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        save_norm_stats(self.norm_stats, directory / "norm_stats.json")
        if self.tokenizer.model_path.resolve() != (directory / "tokenizer.model").resolve():
            shutil.copyfile(self.tokenizer.model_path, directory / "tokenizer.model")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        openpi_bf16_params: bool = False, **overrides: Any) -> "PI0Policy":
        """Load a directory written by ``save_pretrained`` / the converter.

        The model is built on the meta device, allocated once on ``device`` in its final dtypes, and every
        tensor is read from model.safetensors straight into it (peak memory about one checkpoint, no float32
        copy of a bf16 checkpoint, nothing on the CPU beyond one tensor when loading onto a GPU).
        ``overrides`` patch config.json: PolicyConfig fields (n_action_steps, num_steps, ...) or Pi0Config
        fields (dtype="bfloat16", attn_implementation="sdpa", ...). ``openpi_bf16_params`` rounds the
        weights to bf16 as unmodified openpi serving does (see ``PI0Model.round_params_``).
        """
        directory = Path(directory)
        files = checkpoint_io.check_policy_dir(directory)
        try:
            cfg_dict = json.loads(files["config.json"].read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{files['config.json']} is not valid JSON: {e}") from e
        model_fields = {f.name for f in dataclasses.fields(Pi0Config)}
        policy_fields = {f.name for f in dataclasses.fields(PolicyConfig)}
        bad = sorted(set(overrides) - model_fields - policy_fields)
        if bad:
            raise ValueError(f"from_pretrained: unknown override(s) {bad}; valid: PolicyConfig fields "
                             f"{sorted(policy_fields - {'model'})} or Pi0Config fields {sorted(model_fields)}")
        cfg_dict["model"] = {**cfg_dict.get("model", {}), **{k: v for k, v in overrides.items() if k in model_fields}}
        cfg_dict.update({k: v for k, v in overrides.items() if k not in model_fields})
        try:
            config = PolicyConfig.from_dict(cfg_dict)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{files['config.json']}: {e}") from e
        norm_stats = load_norm_stats(files["norm_stats.json"])
        tokenizer = PaligemmaTokenizer(files["tokenizer.model"], config.model.max_token_len)
        with torch.device("meta"):
            model = PI0Model(config.model)  # parameters already in their final dtypes (apply_precision)
        checkpoint_io.check_safetensors_matches(model, files["model.safetensors"], prefix="model.")
        policy = cls(config, norm_stats, tokenizer, model)  # validates stats/tokenizer before allocating
        model.to_empty(device=torch.device(device))
        checkpoint_io.load_safetensors_into(model, files["model.safetensors"], prefix="model.")
        if openpi_bf16_params:
            model.round_params_(torch.bfloat16)
        return policy.eval()

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
