"""Pure attention helpers: block-causal masks, positions, RoPE and the attention kernel itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# as in openpi gemma.py Attention: masked logits are set to this value (not -inf, so rows that are
# fully masked, e.g. padding queries, give a uniform softmax instead of NaN).
BIG_NEG = -2.3819763e38


def make_attn_mask(input_mask: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool valid mask + (B, T) or (T,) bool/int block starts -> (B, T, T) bool attend mask.

    as in openpi pi0.py make_attn_mask: token i may attend to token j iff
    cumsum(ar)[j] <= cumsum(ar)[i] and both tokens are valid. A True in ``ar_mask`` starts a new
    block that earlier tokens cannot see; equal cumsum values form one bidirectional block.
    """
    input_mask = input_mask.bool()
    ar = torch.broadcast_to(ar_mask.to(torch.int64), input_mask.shape)
    cumsum = torch.cumsum(ar, dim=1)
    attn = cumsum[:, None, :] <= cumsum[:, :, None]
    valid = input_mask[:, None, :] & input_mask[:, :, None]
    return attn & valid


def make_positions(input_mask: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
    """(B, T) bool -> (B, T) long positions = offset + cumsum(mask) - 1 (padding does not advance)."""
    return torch.cumsum(input_mask.to(torch.int64), dim=1) - 1 + (
        offset[:, None] if isinstance(offset, torch.Tensor) else offset
    )


def rope_angles(positions: torch.Tensor, head_dim: int, max_wavelength: float = 10_000.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) positions -> (sin, cos) (B, T, 1, H/2) float32 of openpi's RoPE (as in openpi gemma.py _apply_rope)."""
    freq_exponents = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32, device=positions.device)
    timescale = max_wavelength**freq_exponents  # (H/2,)
    radians = positions.to(torch.float32)[..., None] / timescale  # (B, T, H/2)
    radians = radians[..., None, :]  # (B, T, 1, H/2)
    return torch.sin(radians), torch.cos(radians)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: float = 10_000.0) -> torch.Tensor:
    """(B, T, N, H) x, (B, T) positions -> RoPE-rotated x, split-half convention, math in float32.

    as in openpi gemma.py _apply_rope (same as HF rotate_half).
    """
    sin, cos = rope_angles(positions, x.shape[-1], max_wavelength)
    x1, x2 = torch.chunk(x.to(torch.float32), 2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, implementation: str = "eager"
) -> torch.Tensor:
    """Grouped-query attention. q (B,T,N,H) already scaled, k/v (B,S,K,H), mask (B,T,S) bool -> (B,T,N,H).

    as in openpi gemma.py Attention: logits in float32, masked logits = BIG_NEG, softmax in float32,
    probabilities cast back to the value dtype before the weighted sum.
    """
    num_heads, num_kv = q.shape[2], k.shape[2]
    group = num_heads // num_kv
    if implementation == "sdpa":
        # On CPU the fused kernel serves the K key/value heads to the N query heads itself (enable_gqa): the same
        # outputs without (B, S, N, H) copies, and about a quarter less time for a tiny model's attention forward +
        # backward. CUDA's fused kernels refuse enable_gqa with a mask and fall back to the math kernel (O(T S) memory
        # per head), so there the heads are repeated.
        gqa = group > 1 and q.device.type == "cpu"
        if group > 1 and not gqa:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # (B, S, N, H)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, BIG_NEG)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias[:, None], scale=1.0, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, T, N, H)
    b, t, _, h = q.shape
    qg = q.reshape(b, t, num_kv, group, h)  # (B, T, K, G, H)
    logits = torch.einsum("btkgh,bskh->bkgts", qg.float(), k.float())  # (B, K, G, T, S) float32
    logits = logits.masked_fill(~mask[:, None, None], BIG_NEG)
    probs = torch.softmax(logits, dim=-1).to(v.dtype)
    out = torch.einsum("bkgts,bskh->btkgh", probs, v)  # (B, T, K, G, H)
    return out.reshape(b, t, num_heads, h)
