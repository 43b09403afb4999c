"""pi0 network: PaliGemma VLM + Gemma action expert trained by flow matching (PyTorch port of openpi's pi0.py).

``PI0Model`` has openpi's model-level API (``sample_actions`` / ``forward``); the policy around it
(normalization, tokenization, cameras, persistence) is ``pi0.policies.pi0.PI0Policy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pi0.models.attention import make_attn_mask, make_positions
from pi0.models.config import Pi0Config
from pi0.models.fast_sampler import FastSampler
from pi0.models.flow import cfg_combine, euler_integrate, flow_matching_pair, posemb_sincos, sample_time
from pi0.models.flow_sde import (EVERY_STEP, chain_coefficients, gaussian_log_prob, pick_sde_step, sde_integrate,
                                 sde_step_moments, sde_times)
from pi0.models.paligemma_with_expert import KVCache, PaliGemmaWithExpert, pack_kv_cache

# Parameters kept in float32 under openpi's bf16 mixed precision: norms, patch and position embeddings,
# and pi0's own small projections (openpi's nnx.Linear heads have no bf16 dtype, so they compute in float32).
_FP32_PARAM_MARKERS = ("layernorm", "layer_norm", ".norm.", "patch_embedding", "position_embedding")
_FP32_HEADS = ("state_proj.", "action_in_proj.", "action_out_proj.", "action_time_mlp_in.", "action_time_mlp_out.",
               "time_mlp_in.", "time_mlp_out.", "optimality_embedding", "value_head.")


TRAINABLE = ("all", "expert", "lora")  # PI0Model.set_trainable


def _is_fp32_param(name: str) -> bool:
    """True for parameters that stay float32 in bfloat16 mode (pi0.5's adaRMS Dense is a bf16 Dense, not a norm scale)."""
    name = name.removeprefix("model.")
    if ".dense." in name:
        return False
    return (any(m in name for m in _FP32_PARAM_MARKERS) or name.endswith(".norm.weight")
            or name.startswith(_FP32_HEADS))


def param_storage_dtype(name: str, dtype: str) -> torch.dtype:
    """Storage dtype of parameter ``name`` under precision ``dtype`` ("float32" or openpi's "bfloat16" mix)."""
    return torch.float32 if dtype == "float32" or _is_fp32_param(name) else torch.bfloat16


class ValueHead(nn.Module):
    """V(features) for PPO's per-decision baseline: (B, W) -> (B,) float32, a two-layer MLP whose output layer starts
    at zero (V = 0, so the baseline starts as RLOO's alone). Its hidden width is min(W, 256)."""

    def __init__(self, width: int):
        super().__init__()
        hidden = min(width, 256)
        self.fc1, self.fc2, self.out = nn.Linear(width, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.fc2(F.silu(self.fc1(feats.to(self.fc1.weight.dtype)))))
        return self.out(h)[:, 0].float()


class PI0Model(nn.Module):
    """The pi0 / pi0.5 network: prefix (images + language) through PaliGemma, suffix through the action expert.

    pi0's suffix is a state token + H action tokens (action_in_proj(x_t) ++ posemb(t) through an MLP); pi0.5's
    (``cfg.pi05``) is the H action tokens alone, with the time as the adaptive norms' condition.
    """

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.cfg = cfg
        w = cfg.action_expert.width
        self.paligemma_with_expert = PaliGemmaWithExpert(cfg)
        self.action_in_proj = nn.Linear(cfg.action_dim, w)
        if cfg.pi05:  # as in openpi pi0.py: time_mlp_in / time_mlp_out feed the adaRMS condition
            self.time_mlp_in = nn.Linear(w, w)
            self.time_mlp_out = nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(cfg.action_dim, w)
            self.action_time_mlp_in = nn.Linear(2 * w, w)
            self.action_time_mlp_out = nn.Linear(w, w)
        self.action_out_proj = nn.Linear(w, cfg.action_dim)
        self.fast_sampler: FastSampler | None = None  # see enable_fast_sampling
        # a frozen prefix (trainable=expert) runs without gradient and once per window (predict_velocity); False: the
        # joint pass every time, the reference path (tests, the throughput bench's baseline)
        self.cache_frozen_prefix = True
        if cfg.optimality_condition:
            self.optimality_embedding = nn.Parameter(torch.zeros(w))
        if cfg.value_head:
            self.value_head = self._new_value_head()
        self.apply_precision()

    def set_trainable(self, mode: str = "all") -> "PI0Model":
        """Which parameters train: "all"; "expert" (SigLIP and the VLM frozen, as RLinf's train_expert_only: the
        prefix then runs without gradient and the action expert, the projections and the time MLP train); "lora"
        (LoRA adapters on both Gemmas, ``pi0.models.lora.apply_lora`` with openpi's ranks unless applied already,
        + the projections and the time MLP; every base weight frozen)."""
        if mode not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {mode!r}")
        self.requires_grad_(True)
        if mode == "expert":
            self.paligemma_with_expert.paligemma.requires_grad_(False)
        elif mode == "lora":
            from pi0.models.lora import apply_lora, has_lora, is_lora_param
            if not has_lora(self):
                apply_lora(self)
            for name, p in self.paligemma_with_expert.named_parameters():
                p.requires_grad_(is_lora_param(name))
        return self

    def prefix_frozen(self) -> bool:
        """True when no parameter of SigLIP or the VLM trains (``set_trainable("expert")``): the prefix's keys and
        values then depend on the inputs alone and can be computed once per window (``predict_velocity(prefix=)``)."""
        return not any(p.requires_grad for p in self.paligemma_with_expert.paligemma.parameters())

    def caches_prefix(self) -> bool:
        """True when training encodes the prefix once without gradient and differentiates the suffix alone: the
        prefix is frozen and ``cache_frozen_prefix`` is on (off: the joint pass, the reference path)."""
        return self.cache_frozen_prefix and self.prefix_frozen()

    def serves_cached_prefix(self) -> bool:
        """True when a kv cache of the prefix (``encode_prefix``'s, or the sampler's at collection) can stand in for
        the prefix pass in training: :meth:`caches_prefix`, and no pi0.5 value head reads the prefix's output."""
        return self.caches_prefix() and not (self.cfg.pi05 and self.cfg.value_head)

    def set_gradient_checkpointing(self, on: bool = True) -> "PI0Model":
        """Recompute each SigLIP and Gemma layer in backward instead of keeping its activations (training memory)."""
        self.paligemma_with_expert.gradient_checkpointing = bool(on)
        self.paligemma_with_expert.paligemma.vision_tower.vision_model.gradient_checkpointing = bool(on)
        return self

    def enable_optimality_condition(self) -> "PI0Model":
        """Add the zero-initialised optimality embedding (W,) (CFG-style RL); outputs are unchanged until trained."""
        if not self.cfg.optimality_condition:
            self.cfg = dataclasses.replace(self.cfg, optimality_condition=True)
            ref = self.action_in_proj.weight
            self.optimality_embedding = nn.Parameter(torch.zeros(ref.shape[0], dtype=torch.float32, device=ref.device))
        return self

    def enable_value_head(self) -> "PI0Model":
        """Add the value head (:class:`ValueHead`, V = 0 until trained) for PPO's per-decision baseline."""
        if not self.cfg.value_head:
            self.cfg = dataclasses.replace(self.cfg, value_head=True)
            self.paligemma_with_expert.cfg = self.cfg
            self.value_head = self._new_value_head().to(self.action_in_proj.weight.device)
        return self

    def _new_value_head(self) -> ValueHead:
        """A fresh :class:`ValueHead` as wide as the features :meth:`value_from` reads (VLM width for pi0.5, else
        the action expert's)."""
        return ValueHead(self.cfg.paligemma.width if self.cfg.pi05 else self.cfg.action_expert.width)

    def value_from(self, prefix_out: torch.Tensor | None, prefix_pad: torch.Tensor, suffix_out: torch.Tensor | None
                   ) -> torch.Tensor:
        """Value V (B,) float32 of the observation from one forward's outputs, on DETACHED features: pi0's state
        token output (B, W) (it attends to the prefix and itself only, so x_t and t do not change it), or pi0.5's
        mean valid prefix output (B, D). The head trains alone; the policy's trunk never sees the value loss."""
        if self.cfg.pi05:
            assert prefix_out is not None
            m = prefix_pad[..., None].to(prefix_out.dtype)
            feats = (prefix_out * m).sum(1) / m.sum(1).clamp_min(1.0)
        else:
            assert suffix_out is not None
            feats = suffix_out[:, 0]
        return self.value_head(feats.detach().float())

    # ------------------------------------------------------------------ precision
    def set_dtype(self, dtype: str, bf16_precision: str | None = None) -> "PI0Model":
        """Switch to "float32" or "bfloat16" (openpi's mixed precision: bf16 weights and activations, float32 norms
        and heads) and cast the parameters; ``bf16_precision`` ("openpi" | "high", default: keep ``cfg``'s) sets
        whether the float32-stored parameters get bf16 values (``Pi0Config.bf16_precision``)."""
        self.cfg = dataclasses.replace(self.cfg, dtype=dtype, bf16_precision=bf16_precision or self.cfg.bf16_precision)
        self.paligemma_with_expert.cfg = self.cfg
        return self.apply_precision()

    def set_compute_dtype(self, dtype: str) -> "PI0Model":
        """Set the activation dtype ("float32" | "bfloat16") without casting the parameters (FSDP2 mixed precision
        gathers float32 shards as bf16: ``pi0.ript.utils.fsdp``)."""
        self.cfg = dataclasses.replace(self.cfg, dtype=dtype)
        self.paligemma_with_expert.cfg = self.cfg
        return self

    def apply_precision(self) -> "PI0Model":
        """Cast parameters for ``cfg.dtype``: all float32, or bf16 except norms / heads / patch / position embeddings,
        which keep float32 storage and, with ``cfg.bf16_precision == "openpi"``, bf16-rounded values (idempotent:
        also applied after loading a checkpoint)."""
        if self.cfg.dtype == "float32":
            return self.float()
        round_kept = self.cfg.bf16_precision == "openpi"
        for name, p in self.named_parameters():
            keep = _is_fp32_param(name)
            p.data = p.data.to(torch.float32 if keep else torch.bfloat16)
            if keep and round_kept and p.device.type != "meta":
                # as openpi serving: restore_params(dtype=bfloat16) rounds every parameter, and its float32 heads
                # (nnx.Linear without a dtype promotes to float32) then compute on the bf16 values
                with torch.no_grad():
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activation dtype."""
        return self.paligemma_with_expert.compute_dtype

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
                     condition: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """state (B,S), x_t (B,H,A), t (B,), condition (B,) in {0,1} -> embs (B,Ts,W), pad (B,Ts), ar (Ts,),
        adaRMS condition (B,W) or None.

        as in openpi pi0.py embed_suffix. pi0: one state token, then H action tokens made of
        action_in_proj(x_t) ++ posemb(t) -> mlp_in -> swish -> mlp_out; ar = [True, True, False...] (the state token
        and the action block each start a new block). pi0.5: the H action tokens action_in_proj(x_t) alone,
        ar = [True, False...], and posemb(t) -> time_mlp_in -> swish -> time_mlp_out -> swish is the condition of
        the expert's adaptive norms. With ``cfg.optimality_condition`` (after CFGRL, Frans et al. 2025)
        ``condition * optimality_embedding`` is added to the state token (pi0.5: to the time condition);
        ``condition=None`` means unconditioned (0).
        """
        if self.cfg.pi05:
            return self._embed_suffix_pi05(noisy_actions, time, condition)
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
        return emb, pad, ar, None

    def time_condition(self, time: torch.Tensor) -> torch.Tensor:
        """pi0.5: (B,) t -> (B, W) adaRMS condition (as in openpi pi0.py: posemb in float32, two swish MLP layers)."""
        c = posemb_sincos(time, self.action_in_proj.out_features)
        c = F.silu(self._linear(self.time_mlp_in, c))
        return F.silu(self._linear(self.time_mlp_out, c))

    def _embed_suffix_pi05(self, noisy_actions: torch.Tensor, time: torch.Tensor, condition: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """pi0.5's suffix: (B,H,A) x_t, (B,) t -> embs (B,H,W), pad (B,H), ar (H,), condition (B,W)."""
        b, h, _ = noisy_actions.shape
        emb = self._linear(self.action_in_proj, noisy_actions).to(self.compute_dtype)  # (B, H, W)
        cond = self.time_condition(time)  # (B, W) float32
        if condition is not None and self.cfg.optimality_condition:
            cond = cond + condition.to(cond.dtype)[:, None] * self.optimality_embedding.to(cond.dtype)
        pad = torch.ones(b, h, dtype=torch.bool, device=emb.device)
        ar = torch.zeros(h, dtype=torch.bool, device=emb.device)
        ar[0] = True
        return emb, pad, ar, cond

    def _velocity(self, suffix_out: torch.Tensor, h: int) -> torch.Tensor:
        """(B, Ts, W) expert output -> (B, H, A) float32 velocity of the last H (action) tokens.

        H comes from the inputs (x_t), not the config: the horizon a checkpoint was converted with does not limit it.
        """
        return self._linear(self.action_out_proj, suffix_out[:, -h:]).to(torch.float32)

    # ------------------------------------------------------------------ training loss
    def forward(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                lang_masks: torch.Tensor, state: torch.Tensor, actions: torch.Tensor,
                noise: torch.Tensor | None = None, time: torch.Tensor | None = None,
                condition: torch.Tensor | None = None, prefix: tuple[KVCache, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Per-element flow-matching loss (B, H, A) = (v_theta(x_t, t | condition (B,)) - (noise - actions))^2
        (``prefix``: a frozen prefix's cache, see :meth:`predict_velocity`).

        as in openpi pi0.py compute_loss (without the final mean over action dims).
        """
        b = actions.shape[0]
        if noise is None:
            noise = torch.randn_like(actions, dtype=torch.float32)
        if time is None:
            time = sample_time(b, device=actions.device)
        x_t, u_t = flow_matching_pair(actions.float(), noise.float(), time.float())
        v_t = self.predict_velocity(images, img_masks, lang_tokens, lang_masks, state, x_t, time, condition,
                                    prefix=prefix)
        return (v_t - u_t) ** 2

    def predict_velocity(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                         lang_masks: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor, time: torch.Tensor,
                         condition: torch.Tensor | None = None, return_value: bool = False,
                         prefix: tuple[KVCache, torch.Tensor] | None = None
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """v_theta(x_t, t | condition (B,)) (B, H, A) from one joint pass over prefix + suffix (training path);
        with ``return_value`` also the value head's V (B,) of the same pass.

        ``prefix``: (per-layer kv cache (B,Tp,K,H), prefix pad (B,Tp)) of ``encode_prefix`` on these inputs, when the
        prefix is frozen (:meth:`prefix_frozen`): only the suffix runs, on the cache (the same numbers: prefix tokens
        never attend to the suffix), so an update's epochs train the action expert without re-running the VLM. A
        frozen prefix without a cache takes the same path under gradient: it is encoded here without gradient first.
        """
        if prefix is None and torch.is_grad_enabled() and not (self.cfg.pi05 and return_value) \
                and self.caches_prefix():
            # In the joint pass autograd would carry the whole prefix stream (its attention reads the suffix's masked
            # keys, so every prefix activation would be kept and backpropagated to zero effect): 2.4x the time of
            # a tiny model's step, and at full size ~1.5 GB of activations a window. Without it: the same loss and
            # gradients (tests/test_update_prefix_cache.py).
            with torch.no_grad():
                prefix = self.encode_prefix(images, img_masks, lang_tokens, lang_masks)
        if prefix is not None:
            if self.cfg.pi05 and return_value:
                raise ValueError("pi0.5's value head reads the prefix output, which a cached prefix does not keep")
            out = self.denoise_step(prefix[0], prefix[1], state, x_t, time, condition, return_suffix=return_value)
            if not return_value:
                return out
            v, s_out = out
            return v, self.value_from(None, prefix[1], s_out)
        p_emb, p_pad, p_ar = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        s_emb, s_pad, s_ar, s_cond = self.embed_suffix(state, x_t, time, condition)
        pad = torch.cat([p_pad, s_pad], 1)
        mask = make_attn_mask(pad, torch.cat([p_ar, s_ar]))
        (p_out, s_out), _ = self.paligemma_with_expert([p_emb, s_emb], mask, make_positions(pad),
                                                       adarms_cond=[None, s_cond])
        v = self._velocity(s_out, x_t.shape[1])
        return (v, self.value_from(p_out, p_pad, s_out)) if return_value else v

    # ------------------------------------------------------------------ inference
    def encode_prefix(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                      lang_masks: torch.Tensor, return_output: bool = False
                      ) -> tuple[KVCache, torch.Tensor] | tuple[KVCache, torch.Tensor, torch.Tensor]:
        """Run the prefix once -> (per-layer kv cache (B,Tp,K,H) after RoPE, prefix pad mask (B,Tp)
        [, with ``return_output``: the VLM's final-normed prefix output (B,Tp,D)])."""
        emb, pad, ar = self.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        (p_out, _), cache = self.paligemma_with_expert([emb, None], make_attn_mask(pad, ar), make_positions(pad),
                                                       return_kv_cache=True)
        assert cache is not None
        return (cache, pad, p_out) if return_output else (cache, pad)

    def denoise_step(self, kv_cache: KVCache, prefix_pad: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor,
                     time: torch.Tensor, condition: torch.Tensor | None = None, return_suffix: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One velocity evaluation on a cached prefix: x_t (B,H,A), t (B,), condition (B,) -> v_t (B,H,A)
        [, with ``return_suffix``: the expert's suffix output (B,Ts,W)].

        as in openpi pi0.py sample_actions step(): suffix queries see every valid prefix key plus
        the suffix block mask; suffix positions continue from sum(prefix_mask).
        """
        s_emb, s_pad, s_ar, s_cond = self.embed_suffix(state, x_t, time, condition)
        t_s = s_emb.shape[1]
        prefix_part = prefix_pad[:, None, :].expand(-1, t_s, -1)  # (B, Ts, Tp)
        mask = torch.cat([prefix_part, make_attn_mask(s_pad, s_ar)], -1)  # (B, Ts, Tp + Ts)
        positions = make_positions(s_pad, offset=prefix_pad.sum(-1))
        (_, s_out), _ = self.paligemma_with_expert([None, s_emb], mask, positions, kv_cache=kv_cache,
                                                   adarms_cond=[None, s_cond])
        v = self._velocity(s_out, x_t.shape[1])
        return (v, s_out) if return_suffix else v

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

    @torch.no_grad()
    def sample_actions_sde(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                           lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor, num_steps: int = 10,
                           noise_level: float = 0.5, sde_step: int | None = None,
                           generator: torch.Generator | None = None, sde_kind: str = "flow_sde",
                           return_prefix: bool = False) -> dict[str, Any]:
        """Flow-SDE sampling (``pi0.models.flow_sde``): Euler steps, except step ``sde_step`` k (default: drawn
        uniformly from 0..N-1 with ``generator``; ``flow_sde.EVERY_STEP``: all of them), a Gaussian transition of
        ``sde_kind`` (flow_sde, or cps: then k < N-1). noise (B,H,A) ->
        {"actions" (B,H,A), "chain" (B,N+1,H,A): x at t = 1, 1-1/N, ..., 0, "sde_step" k,
         "log_prob" (B,H,A): log N(chain[:, k+1]; mean_k, std_k) elementwise (summed over the stochastic steps),
         "value" (B,) the value head's V of the observation, with ``cfg.value_head``,
         with ``return_prefix``: "prefix" = (the prefix's kv cache packed (B, depth, Tp, 2K, H), its pad (B, Tp)),
         what the update of a frozen prefix reuses instead of encoding it again (``predict_velocity(prefix=)``)}.

        as in RLinf's hybrid ODE/SDE sampler (one stochastic step per call, shared by the batch). With
        ``enable_fast_sampling`` the call goes through ``FastSampler.sample_actions_sde`` (same numbers and generator
        calls; ``tests/test_fast_sampler.py``).
        """
        if self.fast_sampler is not None:
            return self.fast_sampler.sample_actions_sde(images, img_masks, lang_tokens, lang_masks, state, noise,
                                                        num_steps, noise_level, sde_step, generator, sde_kind,
                                                        return_prefix)
        times = sde_times(num_steps)
        sde_step = pick_sde_step(num_steps, sde_step, generator, sde_kind)
        kv_cache, prefix_pad, p_out = self.encode_prefix(images, img_masks, lang_tokens, lang_masks, return_output=True)
        x = noise.float()
        value = None

        def velocity(k: int, x_k: torch.Tensor) -> torch.Tensor:
            nonlocal value
            t = torch.full((x_k.shape[0],), times[k], device=x_k.device)
            v, s_out = self.denoise_step(kv_cache, prefix_pad, state, x_k, t, return_suffix=True)
            if k == 0 and self.cfg.value_head:
                value = self.value_from(p_out, prefix_pad, s_out)
            return v

        coefs = chain_coefficients(num_steps, sde_step, noise_level, x, sde_kind)
        eps = lambda: torch.randn(x.shape, generator=generator, device="cpu").to(x.device)  # noqa: E731
        chain, log_prob = sde_integrate(velocity, x, num_steps, sde_step, coefs, eps)
        out = {"actions": chain[:, -1], "chain": chain, "sde_step": sde_step, "log_prob": log_prob}
        if return_prefix:
            out["prefix"] = (pack_kv_cache(kv_cache), prefix_pad)
        return {**out, "value": value} if value is not None else out

    def step_log_prob(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                      lang_masks: torch.Tensor, state: torch.Tensor, chain: torch.Tensor, sde_step: int | torch.Tensor,
                      num_steps: int, noise_level: float, return_value: bool = False,
                      prefix: tuple[KVCache, torch.Tensor] | None = None, sde_kind: str = "flow_sde"
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """log N(chain[:, k+1]; mean_k(chain[:, k]), std_k) (B,H,A) under the current weights, with gradient
        [, with ``return_value``: the value head's V (B,) from the same pass].

        chain (B,N+1,H,A); ``sde_step`` k: one int, or (B,) per sample; EVERY_STEP (for the whole batch): the sum
        over all N steps (:meth:`chain_log_prob`). The recorded step of ``sample_actions_sde`` re-evaluated (PPO's new
        log-probability); unchanged weights give the recorded ``log_prob``. ``prefix``: a frozen prefix's cache
        (:meth:`predict_velocity`).
        """
        b = chain.shape[0]
        k = torch.as_tensor(sde_step, device=chain.device).long().expand(b)
        if bool((k == EVERY_STEP).any()):
            if not bool((k == EVERY_STEP).all()):
                raise ValueError("a batch mixes whole-chain (EVERY_STEP) windows with one-step windows")
            if return_value:
                raise ValueError("the value baseline reads one step's pass; a whole-chain (EVERY_STEP) ratio has N")
            return self.chain_log_prob(images, img_masks, lang_tokens, lang_masks, state, chain, num_steps,
                                       noise_level, prefix, sde_kind)
        rows = torch.arange(b, device=chain.device)
        t = torch.tensor(sde_times(num_steps), dtype=torch.float32, device=chain.device)[k]  # (B,)
        x = chain[rows, k].float()
        out = self.predict_velocity(images, img_masks, lang_tokens, lang_masks, state, x, t, return_value=return_value,
                                    prefix=prefix)
        v, value = out if return_value else (out, None)
        mean, std = sde_step_moments(x, v, t, 1.0 / num_steps, noise_level, sde_kind)
        lp = gaussian_log_prob(chain[rows, k + 1].float(), mean, std)
        return (lp, value) if return_value else lp

    def chain_log_prob(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                       lang_masks: torch.Tensor, state: torch.Tensor, chain: torch.Tensor, num_steps: int,
                       noise_level: float, prefix: tuple[KVCache, torch.Tensor] | None = None,
                       sde_kind: str = "flow_sde") -> torch.Tensor:
        """sum_k log N(chain[:, k+1]; mean_k(chain[:, k]), std_k) (B,H,A) over all N steps, with gradient: the
        whole chain's log-density given chain[:, 0] (a chain sampled with ``sde_step=EVERY_STEP``).

        The prefix is encoded once (with gradient unless it is frozen, or given as ``prefix``) and its cache serves
        all N velocity evaluations in one suffix pass of N*B rows (step-major), so the cost is one prefix and N
        suffixes, not N whole passes.
        """
        b, n = chain.shape[0], num_steps
        if chain.shape[1] != n + 1:
            raise ValueError(f"chain has {chain.shape[1] - 1} steps, expected num_steps {n}")
        if prefix is None:
            frozen = self.caches_prefix()
            with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
                prefix = self.encode_prefix(images, img_masks, lang_tokens, lang_masks)
        cache = [(kk.repeat(n, *(1,) * (kk.ndim - 1)), vv.repeat(n, *(1,) * (vv.ndim - 1))) for kk, vv in prefix[0]]
        pad = prefix[1].repeat(n, 1)
        t = torch.tensor(sde_times(n), dtype=torch.float32, device=chain.device).repeat_interleave(b)  # (N*B,)
        x = chain[:, :n].float().transpose(0, 1).reshape(n * b, *chain.shape[2:])  # step-major: row k*B + i
        v = self.denoise_step(cache, pad, state.repeat(n, *(1,) * (state.ndim - 1)), x, t)
        mean, std = sde_step_moments(x, v, t, 1.0 / n, noise_level, sde_kind)
        nxt = chain[:, 1:].float().transpose(0, 1).reshape(n * b, *chain.shape[2:])
        return gaussian_log_prob(nxt, mean, std).reshape(n, b, *chain.shape[2:]).sum(0)

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
        """Route ``sample_actions`` and ``sample_actions_sde`` through ``pi0.models.fast_sampler.FastSampler(self, **options)`` (e.g. compile=True,
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
