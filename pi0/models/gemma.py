"""Compact Gemma decoder pieces: RMSNorm, GeGLU MLP, attention projections and decoder layers.

Parameter names follow HF ``GemmaModel`` (``layers.{i}.self_attn.q_proj`` ...) so that openpi and HF /
LeRobot weights map by a plain key map. The layer does not run attention itself: joint attention over
several experts lives in ``pi0.models.paligemma_with_expert``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pi0.models.config import GemmaConfig

RMS_NORM_EPS = 1e-6


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> x * rsqrt(mean(x^2) + eps) in float32 (the part of openpi's RMSNorm before the scale)."""
    xf = x.to(torch.float32)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)


class RMSNorm(nn.Module):
    """as in openpi gemma.py RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + scale), in float32."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D) in x's dtype."""
        return (rms_normalize(x) * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: no scale parameter; a Dense of the condition gives [scale | shift | gate].

    as in openpi gemma.py RMSNorm with ``cond``: out = normalize(x) * (1 + scale) + shift (float32 normalisation,
    the Dense in the activation dtype); the gate multiplies the residual branch this norm feeds.
    """

    def __init__(self, dim: int, cond_dim: int):
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D), cond (B, C) -> (normed (B, T, D) in x's dtype, gate (B, 1, D))."""
        w, b = self.dense.weight.to(x.dtype), self.dense.bias.to(x.dtype)
        scale, shift, gate = F.linear(cond.to(x.dtype), w, b)[:, None].chunk(3, dim=-1)  # 3 x (B, 1, D)
        return (rms_normalize(x) * (1 + scale) + shift).to(x.dtype), gate


def apply_norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed x, residual gate or None) for a plain RMSNorm (cond ignored) or an AdaRMSNorm."""
    if isinstance(norm, AdaRMSNorm):
        if cond is None:
            raise ValueError("an adaptive (pi0.5) norm needs its condition (the time embedding)")
        return norm(x, cond)
    return norm(x), None


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """as in openpi gemma.py _gated_residual: x + y, or x + y * gate with an adaptive norm's gate."""
    return x + y if gate is None else x + y * gate


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttentionProjections(nn.Module):
    """q / k / v / o projections of one expert (no biases; multi-query when num_kv_heads == 1)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, D) -> q (B, T, N, H), k (B, T, K, H), v (B, T, K, H)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return q, k, v


def make_norm(dim: int, cond_dim: int | None) -> nn.Module:
    """RMSNorm, or pi0.5's AdaRMSNorm when the model is conditioned (``cond_dim`` = condition width)."""
    return RMSNorm(dim) if cond_dim is None else AdaRMSNorm(dim, cond_dim)


class GemmaDecoderLayer(nn.Module):
    """Pre-norm block: norm -> attention -> (gated) residual -> norm -> GeGLU MLP -> (gated) residual."""

    def __init__(self, cfg: GemmaConfig, cond_dim: int | None = None):
        super().__init__()
        self.input_layernorm = make_norm(cfg.width, cond_dim)
        self.self_attn = GemmaAttentionProjections(cfg)
        self.post_attention_layernorm = make_norm(cfg.width, cond_dim)
        self.mlp = GemmaMLP(cfg)

    def start(self, x: torch.Tensor, cond: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Residual stream x (B,T,D) -> q (B,T,N,H), k, v (B,T,K,H) of the normed input, and the norm's gate.

        The joint attention of pi0 runs between :meth:`start` and :meth:`finish` (``PaliGemmaWithExpert._layer``);
        under FSDP2 both are registered forward methods, so each gathers this layer's weights.
        """
        normed, gate = apply_norm(self.input_layernorm, x, cond)
        q, k, v = self.self_attn.qkv(normed)
        return q, k, v, gate

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor, gate: torch.Tensor | None = None,
               cond: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stream x (B,T,D) + attention output (B,T,N,H) -> block output (B,T,D).

        ``gate``: the input norm's residual gate; ``cond`` (B, C): the adaptive norms' condition (pi0.5).
        """
        b, t = attn_out.shape[:2]
        x = gated_residual(x, self.self_attn.o_proj(attn_out.reshape(b, t, -1)), gate)
        normed, gate = apply_norm(self.post_attention_layernorm, x, cond)
        return gated_residual(x, self.mlp(normed), gate)


class GemmaModel(nn.Module):
    """Token embedding (optional: the action expert has none), decoder layers, final norm.

    ``cond_dim``: every norm is adaptive (pi0.5's action expert, conditioned on the time embedding).
    """

    def __init__(self, cfg: GemmaConfig, vocab_size: int | None, cond_dim: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, cfg.width) if vocab_size else None
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, cond_dim) for _ in range(cfg.depth)])
        self.norm = make_norm(cfg.width, cond_dim)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) long -> (B, L, D) embeddings scaled by sqrt(D) (as in openpi gemma.py Embedder.encode)."""
        assert self.embed_tokens is not None, "this Gemma has no token embedding"
        x = self.embed_tokens(tokens)
        return x * torch.tensor(self.cfg.width**0.5, dtype=x.dtype)
