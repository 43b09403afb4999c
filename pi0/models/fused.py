"""Fused Gemma layers for ``FastSampler``: fewer, larger kernels computing the eager numbers (float32: within 1e-5).

Derived from a ``PI0Model``'s weights by :class:`FusedWeights` (rebuilt in place when they change):

* q/k/v of a layer in one GEMM, gate/up in one GEMM (LoRA updates merged in);
* a plain RMSNorm's (1 + scale) folded into the columns of the linear it feeds: as in openpi gemma.py RMSNorm,
  out = normalize(x) * (1 + scale), so W out = (W diag(1 + scale)) normalize(x) (exact in real arithmetic); the
  final norm folds into ``action_out_proj`` the same way;
* pi0.5's adaRMS norms cannot fold a fixed scale, but their time conditions are fixed per Euler time: the
  [scale | shift | gate] of every norm of every layer come from ONE GEMM per Euler time, computed once per sampler
  (not per call), and the final adaRMS norm folds into ``action_out_proj`` per Euler time;
* RoPE on q, k and v at once as x * cos + roll(x, H/2) * sin (v's tables: cos 1, sin 0, exact; the attention scale
  head_dim**-0.5 folded into q's tables), keys/values written straight into the static KV cache, and one SDPA
  (grouped-query, float mask bias as openpi's BIG_NEG) for the prefix and for each suffix pass.

The eager modules (``pi0.models.gemma``, ``pi0.models.paligemma_with_expert``) stay the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pi0.models.attention import BIG_NEG, rope_angles
from pi0.models.gemma import RMS_NORM_EPS, AdaRMSNorm, GemmaModel

Modulation = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # adaRMS (1 + scale, shift, gate), each (1, 1, D)


@dataclass
class FusedLayer:
    """One Gemma decoder layer's weights (Gemma's linears have no bias)."""

    qkv: torch.Tensor  # ((N + 2K) H, D): [q; k; v], the input norm's (1 + scale) folded into the columns
    o: torch.Tensor  # (D, N H)
    gate_up: torch.Tensor  # (2 M, D): [gate; up], the post-attention norm's (1 + scale) folded in
    down: torch.Tensor  # (D, M)


def linear_weight(lin: nn.Linear) -> torch.Tensor:
    """(out, in) weight of ``lin``, with a LoRA update merged in (``pi0.models.lora.LoRALinear.delta``)."""
    w = lin.weight.detach()
    delta = getattr(lin, "delta", None)
    return (w.float() + delta().detach().to(w.device)).to(w.dtype) if callable(delta) else w


def fold_norm_scale(w: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """(out, in) weight W fed by a plain RMSNorm -> W diag(1 + scale), the product in float64 rounded once to W's
    dtype; an adaptive norm's scale depends on the time and is not folded (W returned as is)."""
    if isinstance(norm, AdaRMSNorm):
        return w.contiguous()
    return (w.double() * (1.0 + norm.weight.detach().double())[None, :]).to(w.dtype)


def fuse_layer(layer: nn.Module) -> FusedLayer:
    """``GemmaDecoderLayer`` -> :class:`FusedLayer` (q/k/v and gate/up concatenated, norm scales folded)."""
    at, mlp = layer.self_attn, layer.mlp
    qkv = torch.cat([linear_weight(at.q_proj), linear_weight(at.k_proj), linear_weight(at.v_proj)])
    gate_up = torch.cat([linear_weight(mlp.gate_proj), linear_weight(mlp.up_proj)])
    return FusedLayer(fold_norm_scale(qkv, layer.input_layernorm), linear_weight(at.o_proj),
                      fold_norm_scale(gate_up, layer.post_attention_layernorm), linear_weight(mlp.down_proj))


def adarms_stack(gemma: GemmaModel) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every adaRMS Dense of ``gemma`` stacked, in the order (layer 0 input, layer 0 post-attention, ..., final):
    weight ((2L + 1) 3D, C), bias ((2L + 1) 3D,); None for plain norms."""
    norms = [n for lay in gemma.layers for n in (lay.input_layernorm, lay.post_attention_layernorm)] + [gemma.norm]
    if not isinstance(norms[0], AdaRMSNorm):
        return None
    return (torch.cat([n.dense.weight.detach() for n in norms]), torch.cat([n.dense.bias.detach() for n in norms]))


def adarms_modulations(stack: tuple[torch.Tensor, torch.Tensor], cond: torch.Tensor, dtype: torch.dtype,
                       width: int) -> list[Modulation]:
    """cond (1, C) -> per norm (1 + scale, shift, gate) (1, 1, D) in ``dtype``: every norm's Dense in ONE GEMM.

    as in ``AdaRMSNorm.forward`` (the Dense in the activation dtype, then [scale | shift | gate]).
    """
    w, b = stack
    mod = F.linear(cond.to(dtype), w.to(dtype), b.to(dtype))  # (1, (2L + 1) 3D)
    out = []
    for chunk in mod.view(1, -1, 3, width).unbind(1):  # (1, 3, D) per norm
        scale, shift, gate = (c[:, None] for c in chunk.unbind(1))  # 3 x (1, 1, D)
        out.append((1 + scale, shift, gate))
    return out


def rms(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., D) -> x * rsqrt(mean(x^2) + eps) computed in float32 (as ``pi0.models.gemma.rms_normalize``), returned
    in ``dtype`` (one rounding, as the eager norm's cast to the activation dtype)."""
    xf = x if x.dtype == torch.float32 else x.float()
    out = F.rms_norm(xf, (xf.shape[-1],), eps=RMS_NORM_EPS)
    return out if dtype == torch.float32 else out.to(dtype)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype`` without dispatching an op when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


def rope_tables(positions: torch.Tensor, num_heads: int, num_kv: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) positions -> (cos, sin) (B, T, N + 2K, H) float32 such that x * cos + roll(x, H/2) * sin is openpi's
    RoPE on q (times head_dim**-0.5, the attention scale) and k, and the identity on v.

    as in openpi gemma.py _apply_rope: [x1 cos - x2 sin, x2 cos + x1 sin]; roll(x, H/2) = [x2, x1].
    """
    sin, cos = rope_angles(positions, head_dim)  # (B, T, 1, H/2)
    cos_h, sin_h = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # (B, T, 1, H)
    b, t = positions.shape
    scale = head_dim ** -0.5
    shape = (b, t, num_kv, head_dim)
    cos_t = torch.cat([(cos_h * scale).expand(b, t, num_heads, -1), cos_h.expand(shape), cos_h.new_ones(shape)], 2)
    sin_t = torch.cat([(sin_h * scale).expand(b, t, num_heads, -1), sin_h.expand(shape), sin_h.new_zeros(shape)], 2)
    return cos_t, sin_t


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, S) bool attend mask -> (B, 1, T, S) additive bias: 0, or openpi's BIG_NEG (a fully masked row gives a
    uniform softmax, not NaN, as in ``pi0.models.attention.attention``)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, BIG_NEG)[:, None]


def fused_layer(hs: list[torch.Tensor], layers: list[FusedLayer], mods: list[tuple[Modulation, Modulation] | None],
                cos: torch.Tensor, sin: torch.Tensor, kv_new: torch.Tensor, k_all: torch.Tensor,
                v_all: torch.Tensor, bias: torch.Tensor, num_heads: int, dtype: torch.dtype, finish: bool = True
                ) -> list[torch.Tensor]:
    """One joint decoder layer (as ``PaliGemmaWithExpert._layer``) on fused weights.

    hs[i] (B, T_i, D_i): residual streams of the experts (tokens in this order); mods[i]: adaRMS modulations of the
    layer's two norms, or None (plain norms, folded); cos/sin (B, T, N + 2K, H) from :func:`rope_tables`; kv_new
    (B, T, 2K, H): the cache slots this layer's keys/values go to; k_all/v_all (B, K, S, H): all keys/values the
    queries see (views of the same cache, kv_new included); bias (B, 1, T, S). ``finish=False`` stops after writing
    the cache (the last prefix layer's output feeds nothing) -> new hs.
    """
    parts = []
    for h, lay, mod in zip(hs, layers, mods):
        if mod is None:
            n = rms(h, dtype)
        else:  # as in AdaRMSNorm: normalize(x) * (1 + scale) + shift, in float32
            n = cast(torch.addcmul(mod[0][1], rms(h), mod[0][0]), dtype)
        parts.append(F.linear(n, lay.qkv))  # (B, T_i, (N + 2K) H)
    qkv = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    b, t = qkv.shape[:2]
    hd = cos.shape[-1]
    r = cast(qkv.view(b, t, -1, hd), torch.float32)  # (B, T, N + 2K, H); RoPE in float32 as openpi's
    r = cast(torch.addcmul(r * cos, r.roll(hd // 2, -1), sin), dtype)
    q, kv = r.split([num_heads, r.shape[2] - num_heads], 2)
    kv_new.copy_(kv)
    if not finish:
        return hs
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=bias, scale=1.0,
                                       enable_gqa=True)  # (B, N, T, H); q carries the scale
    o = o.transpose(1, 2).reshape(b, t, -1)  # (B, T, N H)
    out, start = [], 0
    for h, lay, mod in zip(hs, layers, mods):
        oi = o if len(hs) == 1 else o[:, start:start + h.shape[1]]
        start += h.shape[1]
        a = F.linear(oi, lay.o)
        h = h + a if mod is None else torch.addcmul(h, a, mod[0][2])  # as in openpi gemma.py _gated_residual
        if mod is None:
            n = rms(h, dtype)
        else:
            n = cast(torch.addcmul(mod[1][1], rms(h), mod[1][0]), dtype)
        gate, up = F.linear(n, lay.gate_up).chunk(2, -1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, lay.down)
        out.append(h + y if mod is None else torch.addcmul(h, y, mod[1][2]))
    return out


def cache_views(kv: torch.Tensor, num_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache (B, S, 2K, H) -> k, v (B, K, S, H) views (what SDPA reads)."""
    return kv[:, :, :num_kv].transpose(1, 2), kv[:, :, num_kv:].transpose(1, 2)


class FusedWeights:
    """The fused weights of a ``PI0Model`` (both Gemmas' layers, the folded output head, pi0.5's adaRMS stack).

    :meth:`refresh` rebuilds them when any parameter changed (``_version`` or storage), in place where the shapes
    allow, so CUDA graphs that read them stay valid across RL updates.
    """

    def __init__(self, model: Any):
        self.model = model
        self.generation = 0  # bumped on every rebuild (time constants depending on these weights key on it)
        self._key: tuple = ()
        self.vlm: list[FusedLayer] = []
        self.expert: list[FusedLayer] = []
        self.out_w = self.out_b = torch.empty(0)
        self.ada: tuple[torch.Tensor, torch.Tensor] | None = None
        self.refresh()

    def _derive(self) -> dict[str, Any]:
        m = self.model
        vlm, expert = m.paligemma_with_expert.experts
        out_w, out_b = linear_weight(m.action_out_proj), m.action_out_proj.bias.detach()
        if not m.cfg.pi05:  # as in openpi: the expert's final RMSNorm feeds action_out_proj
            out_w = fold_norm_scale(out_w, expert.norm)
        return {"vlm": [fuse_layer(lay) for lay in vlm.layers], "expert": [fuse_layer(lay) for lay in expert.layers],
                "out_w": out_w, "out_b": out_b, "ada": adarms_stack(expert)}

    def refresh(self) -> bool:
        """Rebuild if the model's parameters changed since the last build -> whether they did."""
        params = list(self.model.parameters())
        ptrs = tuple(p.data_ptr() for p in params)
        key = (ptrs, tuple(p._version for p in params))
        if key == self._key:
            return False
        with torch.no_grad():
            new = self._derive()
            old = [self.vlm, self.expert, self.out_w, self.out_b, self.ada]
            fresh = [new["vlm"], new["expert"], new["out_w"], new["out_b"], new["ada"]]
            if self._key and self._key[0] == ptrs and _same_shapes(old, fresh):  # an in-place update (optimizer)
                _copy_into(old, fresh)
            else:  # first build, or re-allocated weights (.to(), p.data = ...): FastSampler drops its CUDA graphs
                self.vlm, self.expert, self.out_w, self.out_b, self.ada = fresh
        self._key = key
        self.generation += 1
        return True


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure of lists / tuples / FusedLayers, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, FusedLayer):
        return [obj.qkv, obj.o, obj.gate_up, obj.down]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _same_shapes(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(ta, tb))


def _copy_into(old: Any, new: Any) -> None:
    for dst, src in zip(_tensors(old), _tensors(new)):
        if dst.data_ptr() != src.data_ptr():  # parameters used as they are need no copy
            dst.copy_(src)
