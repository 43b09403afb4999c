"""PaliGemma (SigLIP + Gemma) with a second Gemma "action expert", joined by shared attention.

as in openpi gemma.py Module (the mixture of experts over token groups): every expert keeps its own
norms, q/k/v/o projections and MLP; at each layer the q, k, v of all experts are concatenated along
the sequence, ONE attention runs over them, and the output is split back per expert.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pi0.models.attention import apply_rope, attention
from pi0.models.config import Pi0Config
from pi0.models.gemma import GemmaModel, apply_norm
from pi0.models.siglip import SiglipVisionTower

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v (B, S, K, H), after RoPE


def pack_kv_cache(cache: KVCache) -> torch.Tensor:
    """Per-layer k, v (B, S, K, H) -> one tensor (B, depth, S, 2K, H), keys then values (the fused sampler's layout),
    so that a batch of caches slices per sample like any other array."""
    return torch.stack([torch.cat([k, v], 2) for k, v in cache], 1)


def unpack_kv_cache(packed: torch.Tensor) -> KVCache:
    """Inverse of :func:`pack_kv_cache`: (B, depth, S, 2K, H) -> per-layer k, v (B, S, K, H) views."""
    kv = packed.shape[3] // 2
    return [(packed[:, i, :, :kv], packed[:, i, :, kv:]) for i in range(packed.shape[1])]


class MultiModalProjector(nn.Module):
    """SigLIP width -> Gemma width (openpi's ``img/head`` Dense)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, Wv) -> (B, P, D)."""
        return self.linear(x)


class LanguageModel(nn.Module):
    """HF-compatible nesting: ``language_model.model.*``."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.model = GemmaModel(cfg.paligemma, cfg.vocab_size)


class PaliGemma(nn.Module):
    """Vision tower + projector + Gemma backbone."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = MultiModalProjector(cfg.vision.width, cfg.paligemma.width)
        self.language_model = LanguageModel(cfg)


class ActionExpert(nn.Module):
    """HF-compatible nesting: ``gemma_expert.model.*`` (no token embedding)."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        # pi0.5: every norm is adaptive, conditioned on the time embedding (expert width)
        cond_dim = cfg.action_expert.width if getattr(cfg, "pi05", False) else None
        self.model = GemmaModel(cfg.action_expert, vocab_size=None, cond_dim=cond_dim)


class PaliGemmaWithExpert(nn.Module):
    """The two-expert transformer of pi0 (expert 0 = PaliGemma's Gemma, expert 1 = action expert)."""

    def __init__(self, cfg: Pi0Config):
        super().__init__()
        self.cfg = cfg
        self.paligemma = PaliGemma(cfg)
        self.gemma_expert = ActionExpert(cfg)
        # training memory: recompute each transformer layer in backward instead of storing its activations
        self.gradient_checkpointing = False

    @property
    def experts(self) -> tuple[GemmaModel, GemmaModel]:
        """(VLM Gemma, action expert Gemma)."""
        return self.paligemma.language_model.model, self.gemma_expert.model

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activation dtype: bfloat16 in openpi's mixed precision, else float32."""
        return torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32

    def embed_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, 224, 224) in [-1, 1] -> (B, 256, D) image tokens (not scaled by sqrt(D))."""
        x = self.paligemma.vision_tower(pixels, self.compute_dtype)
        return self.paligemma.multi_modal_projector(x)

    def embed_language(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) long -> (B, L, D) token embeddings multiplied by sqrt(D)."""
        return self.experts[0].embed(tokens).to(self.compute_dtype)

    def forward(
        self,
        inputs_embeds: list[torch.Tensor | None],
        attn_mask: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None = None,
        return_kv_cache: bool = False,
        adarms_cond: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor | None], KVCache | None]:
        """Joint forward. inputs_embeds[i] (B, T_i, D_i) or None, attn_mask (B, sum T_i, S_cache + sum T_i),
        positions (B, sum T_i), adarms_cond[i] (B, C) or None (pi0.5's expert) -> (per-expert final-normed
        outputs (B, T_i, D_i) or None, new kv cache).
        """
        active = [i for i, x in enumerate(inputs_embeds) if x is not None]
        hidden = tuple(inputs_embeds[i] for i in active)
        conds = tuple(adarms_cond[i] if adarms_cond is not None else None for i in active)
        new_cache: KVCache = []
        for layer_idx in range(self.cfg.paligemma.depth):
            past = kv_cache[layer_idx] if kv_cache is not None else None
            args = (layer_idx, tuple(active), hidden, conds, attn_mask, positions, past)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                hidden, k, v = checkpoint(self._layer, *args, use_reentrant=False)
            else:
                hidden, k, v = self._layer(*args)
            if return_kv_cache:
                new_cache.append((k, v))
        hidden = dict(zip(active, hidden))
        conds = dict(zip(active, conds))
        experts = self.experts
        outputs: list[torch.Tensor | None] = [None] * len(inputs_embeds)
        for i in active:
            outputs[i] = apply_norm(experts[i].norm, hidden[i], conds[i])[0]  # final_norm_1's gate is unused
        return outputs, (new_cache if return_kv_cache else None)

    def _layer(self, layer_idx: int, active: tuple[int, ...], hidden: tuple[torch.Tensor, ...],
               conds: tuple[torch.Tensor | None, ...], attn_mask: torch.Tensor, positions: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """One joint layer: per-expert hidden (B, T_i, D_i) -> new hidden, and this layer's k, v (B, T, K, H) after
        RoPE (for the KV cache). ``past``: the cached prefix k, v of this layer, attended to before the new tokens."""
        experts = self.experts
        qs, ks, vs, gates = [], [], [], []
        for i, h, c in zip(active, hidden, conds):
            q, k, v, gate = experts[i].layers[layer_idx].start(h, c)
            qs.append(q), ks.append(k), vs.append(v), gates.append(gate)
        q, k, v = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)  # (B, T, N|K, H)
        # as in openpi gemma.py Attention: RoPE on q and k, then q *= head_dim**-0.5.
        q = apply_rope(q, positions) * torch.tensor(q.shape[-1] ** -0.5, dtype=q.dtype)
        k = apply_rope(k, positions)
        k_all, v_all = k, v
        if past is not None:
            k_all, v_all = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        out = attention(q, k_all, v_all, attn_mask, self.cfg.attn_implementation)  # (B, T, N, H)
        lengths = [h.shape[1] for h in hidden]
        new = tuple(experts[i].layers[layer_idx].finish(h, chunk, gate, c)
                    for i, h, chunk, gate, c in zip(active, hidden, torch.split(out, lengths, dim=1), gates, conds))
        return new, k, v
