"""SigLIP vision tower (big_vision ViT with learned position embedding and no pooling).

Parameter names follow HF ``SiglipVisionModel`` so HF / LeRobot weights load by a plain key map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pi0.models.config import SiglipConfig

LAYER_NORM_EPS = 1e-6  # flax nn.LayerNorm default, as used by big_vision


class SiglipAttention(nn.Module):
    """Multi-head self-attention with biases (flax MultiHeadDotProductAttention)."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.width // cfg.num_heads
        self.q_proj = nn.Linear(cfg.width, cfg.width)
        self.k_proj = nn.Linear(cfg.width, cfg.width)
        self.v_proj = nn.Linear(cfg.width, cfg.width)
        self.out_proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, W) -> (B, P, W)."""
        b, p, w = x.shape
        q, k, v = (proj(x).view(b, p, self.num_heads, self.head_dim).transpose(1, 2) for proj in
                   (self.q_proj, self.k_proj, self.v_proj))  # (B, N, P, H)
        q = q / self.head_dim**0.5  # flax scales the query before the dot product
        probs = torch.softmax(torch.matmul(q.float(), k.float().transpose(-1, -2)), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, p, w)
        return self.out_proj(out)


class SiglipMLP(nn.Module):
    """Dense -> GELU(tanh) -> Dense."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, W) -> (B, P, W)."""
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm ViT block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=LAYER_NORM_EPS)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=LAYER_NORM_EPS)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, W) -> (B, P, W)."""
        x = x + self.self_attn(_layer_norm(self.layer_norm1, x))
        return x + self.mlp(_layer_norm(self.layer_norm2, x))


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm computed in the norm's (float32) dtype, result cast back to x's dtype."""
    return ln(x.to(ln.weight.dtype)).to(x.dtype)


class SiglipEmbeddings(nn.Module):
    """Patchify with a stride-p conv, then add the learned position embedding."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) float in [-1, 1] -> (B, P, W) with P = (S / patch)^2, row-major patches."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(w.dtype))  # (B, W, S/p, S/p)
        x = x.flatten(2).transpose(1, 2)  # (B, P, W)
        return x + self.position_embedding.weight[None]


class SiglipVisionTransformer(nn.Module):
    """Embeddings -> encoder layers -> final LayerNorm (no pooling head)."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([SiglipEncoderLayer(cfg) for _ in range(cfg.depth)])
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=LAYER_NORM_EPS)
        self.gradient_checkpointing = False  # training memory: recompute each layer in backward

    def forward(self, pixels: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """(B, 3, S, S) -> (B, P, W) in ``compute_dtype``."""
        x = self.embeddings(pixels).to(compute_dtype)
        for layer in self.encoder.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():  # recompute in backward (training memory)
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return _layer_norm(self.post_layernorm, x)


class SiglipVisionTower(nn.Module):
    """HF-compatible wrapper so parameters are named ``vision_tower.vision_model.*``."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.vision_model = SiglipVisionTransformer(cfg)

    def forward(self, pixels: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """(B, 3, S, S) -> (B, P, W)."""
        return self.vision_model(pixels, compute_dtype)
