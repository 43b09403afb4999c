"""A fast pi0 sampler that computes the eager ``PI0Model.sample_actions`` numbers (float32: within 1e-5).

``FastSampler(model)`` runs the same flow-matching Euler loop with:

* prompt padding beyond the longest prompt of the batch trimmed from the prefix (exact: padded keys are
  masked out and padding does not advance positions); all live cameras in one SigLIP pass (a camera masked
  in every sample stays skipped);
* the state token hoisted out of the Euler loop: it cannot attend to the action tokens (block-causal
  mask), so its keys/values are computed once, in the same pass as the prefix, and appended to the cache;
* the action input projection folded into the time MLP (two back-to-back linears, exact in real
  arithmetic) and the time half of that MLP precomputed per Euler time (pi0.5: the adaRMS time condition
  precomputed per Euler time; pi0.5 has no state token);
* static-shape KV caches (capacity bucketed, masked tail) so the denoise step has one shape per batch size;
* ``fuse_layers`` (default): the Gemma layers of the prefix pass and of every Euler step run on fused weights
  (``pi0.models.fused``: q/k/v and gate/up in one GEMM each, RMSNorm scales folded into the next linear, pi0.5's
  adaRMS modulations precomputed per Euler time, RoPE and the KV-cache write in a few ops, SDPA), about a third of
  the operators per call (``bench/sampling.py --count_ops``); the last prefix layer stops after its keys/values;
* optionally ``torch.compile`` on the denoise step (``compile_prefix``: SigLIP and the prefix pass too) and, on
  CUDA, CUDA graphs replayed with copy-in / copy-out. ``graph_scope="call"`` (default) captures the whole call:
  SigLIP, the prefix pass, the cache set-up and every Euler step, one graph per (batch size, live cameras,
  prompt bucket, num_steps[, stochastic step]); the data-dependent choices (which cameras are live, where the
  prompt padding starts) are read on the host once per call before the replay (:meth:`FastSampler.plan`), so
  nothing inside the graph synchronises. ``graph_scope="loop"`` captures the Euler loop only (the prefix runs
  un-captured, as before this option).

``FastSampler.sample_actions_sde`` runs Flow-SDE (``pi0.models.flow_sde``, RL collection) on the same cached prefix,
static buffers and step function, with the eager sampler's generator calls (CUDA graph: one per stochastic step).

The eager ``PI0Model.sample_actions`` / ``sample_actions_sde`` stay the reference; ``tests/test_fast_sampler.py``
checks parity.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from pi0.models.attention import make_attn_mask, make_positions
from pi0.models.cuda_graphs import GraphCache, clone_outputs
from pi0.models.flow import euler_integrate, posemb_sincos
from pi0.models.fused import (FusedWeights, _copy_into, adarms_modulations, cache_views, cast, fused_layer,
                              mask_bias, rms, rope_tables)
from pi0.models.flow_sde import chain_coefficients, pick_sde_step, sde_integrate, sde_steps, sde_times

BACKENDS = ("inductor", "aot_eager", "eager")
GRAPH_SCOPES = ("call", "loop")
PROMPT_BUCKET = 16  # graphed or compiled calls trim the prompt to a multiple of this: few shapes, few graphs


def trim_prompt_padding(tokens: torch.Tensor, mask: torch.Tensor, multiple: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, mask (B, L) -> (B, L'): L' = 1 + last column where any sample has a valid token, rounded up to
    ``multiple`` (few shapes for torch.compile) and kept within [1, L]."""
    valid_cols = mask.bool().any(0)  # (L,)
    idx = torch.nonzero(valid_cols)
    keep = max(int(idx[-1]) + 1, 1) if idx.numel() else 1
    keep = min(round_up(keep, multiple), mask.shape[1])
    return tokens[:, :keep], mask[:, :keep]


def euler_times(num_steps: int) -> list[float]:
    """The float32 times t (1.0, 0.9, ...) at which ``pi0.models.flow.euler_integrate`` evaluates the velocity."""
    return list(_euler_times(num_steps))


@functools.lru_cache(maxsize=64)
def _euler_times(num_steps: int) -> tuple[float, ...]:
    """:func:`euler_times`, computed once per ``num_steps`` (it runs the integrator: ops not worth a call)."""
    times: list[float] = []

    def record(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        times.append(float(t[0]))
        return torch.zeros_like(x)

    euler_integrate(record, torch.zeros(1, 1, 1), num_steps)
    return tuple(times)


def fold_action_time_mlp(w_in: torch.Tensor, b_in: torch.Tensor, w_mlp: torch.Tensor, b_mlp: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold action_in_proj (W,A),(W,) into action_time_mlp_in (W,2W),(W,) -> (W_x (W,A), W_t (W,W), b (W,)).

    mlp_in([W_in x + b_in, e]) = W_a W_in x + W_t e + (W_a b_in + b_mlp) with W_mlp = [W_a | W_t];
    products are taken in float64 and rounded once to the weights' dtype.
    """
    w = w_in.shape[0]
    w_a, w_t = w_mlp[:, :w].double(), w_mlp[:, w:]
    w_x = (w_a @ w_in.double()).to(w_in.dtype)
    bias = (w_a @ b_in.double() + b_mlp.double()).to(b_mlp.dtype)
    return w_x, w_t.contiguous(), bias


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple


@dataclass
class _Buffers:
    """Static tensors of one (batch, cache capacity) shape: KV cache, masks, positions, noise in, and the tensor
    arguments of the step function (``step_args``: the same objects on every call, as a CUDA graph needs)."""

    k: list[torch.Tensor]  # unfused: depth x (B, C, K, H)
    v: list[torch.Tensor]
    key_valid: torch.Tensor  # (B, C) bool
    mask: torch.Tensor  # (B, Ha, C + Ha) bool: action queries -> cache keys ++ action keys
    positions: torch.Tensor  # (B, Ha) long
    x: torch.Tensor  # (B, Ha, A) float32 noise
    kv: list[torch.Tensor] = field(default_factory=list)  # fused: depth x (B, C + Ha, 2K, H), cache ++ actions
    bias: torch.Tensor | None = None  # fused: (B, 1, Ha, C + Ha) additive mask of the action queries
    cos: torch.Tensor | None = None  # fused: (B, Ha, N + 2K, H) RoPE tables of the action tokens (fused.rope_tables)
    sin: torch.Tensor | None = None
    step_args: tuple = ()
    n_prefix: int = 0  # cache slots of the prefix proper (before pi0's state token) in the last encode


class FastSampler:
    """Drop-in ``sample_actions`` for a ``PI0Model`` with exact FLOP savings, torch.compile and CUDA graphs."""

    def __init__(self, model: Any, compile: bool = False, backend: str = "inductor", cuda_graph: bool | None = None,
                 trim_prompt: bool = True, fuse_projections: bool = True, batch_cameras: bool = True,
                 cache_bucket: int = 16, warmup: int = 2, compile_prefix: bool = False, fuse_layers: bool = True,
                 graph_scope: str = "call"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if graph_scope not in GRAPH_SCOPES:
            raise ValueError(f"graph_scope must be one of {GRAPH_SCOPES}, got {graph_scope!r}")
        if cache_bucket < 1:
            raise ValueError(f"cache_bucket must be >= 1, got {cache_bucket}")
        self.model = model
        self.options = dict(compile=compile, backend=backend, cuda_graph=cuda_graph, trim_prompt=trim_prompt,
                            fuse_projections=fuse_projections, batch_cameras=batch_cameras,
                            cache_bucket=cache_bucket, warmup=warmup, compile_prefix=compile_prefix,
                            fuse_layers=fuse_layers, graph_scope=graph_scope)
        self.compile, self.backend, self.cuda_graph = compile, backend, cuda_graph
        self.trim_prompt, self.fuse_projections, self.batch_cameras = trim_prompt, fuse_projections, batch_cameras
        self.cache_bucket, self.warmup = cache_bucket, warmup
        # fuse_layers: the Gemma layers of the prefix and of every Euler step on fused weights (pi0.models.fused)
        self.fuse_layers = fuse_layers
        self._fw: FusedWeights | None = None  # built on first use, refreshed when the weights change
        step = self._fused_step if fuse_layers else self._step
        self._step_fn = torch.compile(step, backend=backend, dynamic=False) if compile else step
        # compile_prefix: SigLIP and the prefix transformer pass compiled too (prompt trimmed to multiples of 16
        # so that only a few prefix shapes occur); camera skipping and trimming stay outside (data-dependent).
        # Built on first use: a deep copy binds a model whose attributes are not filled in yet.
        self.compile_prefix = compile_prefix
        self._prefix_fns: tuple[Any, Any] | None = None
        self._buffers: dict[tuple, _Buffers] = {}
        self._consts: dict[tuple, dict[str, Any]] = {}
        # graph_scope "call": SigLIP + prefix + Euler loop in one CUDA graph; "loop": the Euler loop only
        self.graph_scope = graph_scope
        self.graphs = GraphCache(warmup)  # the captured graphs and their static inputs (pi0.models.cuda_graphs)
        self._param_ptrs: tuple[int, ...] = ()

    @property
    def graph_error(self) -> str | None:
        """Why CUDA-graph capture fell back (call -> loop -> un-captured), or None."""
        return self.graphs.error

    @property
    def fused(self) -> bool:
        """Whether pi0's action projection is folded into its time MLP (pi0.5 has no such MLP)."""
        return self.fuse_projections and not self.model.cfg.pi05

    def __deepcopy__(self, memo: dict) -> "FastSampler":
        """A fresh sampler (nothing compiled or captured) bound to the deep-copied model."""
        return FastSampler(memo.get(id(self.model), copy.deepcopy(self.model, memo)), **self.options)

    # ------------------------------------------------------------------ constants
    def _use_graph(self, device: torch.device) -> bool:
        """Whether to capture the Euler loop: auto (None) means 'on CUDA'; True on CPU is an error."""
        if self.cuda_graph is None:
            return device.type == "cuda"
        if self.cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a CUDA model, but the model is on {device}; "
                             "use cuda_graph=None (auto) or False")
        return bool(self.cuda_graph)

    def _time_inputs(self, times: list[float], batch: int, device: torch.device) -> list[torch.Tensor]:
        """Per-Euler-step time inputs of the step function at ``times`` (kept alive: CUDA graphs read them).

        Fused: c_i (W,) = W_t posemb(t_i) + b, then W_x; unfused: posemb(t_i) (B, Ha, W); pi0.5: the (1, W)
        adaRMS condition (``fuse_layers``: :meth:`_pi05_step_consts` of it). Recomputed in place when the head
        weights change (their ``_version``; with fused layers, any weight), so training updates are picked up.
        """
        m = self.model
        if m.cfg.pi05:
            heads = tuple(p for mod in (m.time_mlp_in, m.time_mlp_out) for p in (mod.weight, mod.bias))
        else:
            heads = (m.action_in_proj.weight, m.action_in_proj.bias, m.action_time_mlp_in.weight,
                     m.action_time_mlp_in.bias)
        version = tuple(p._version for p in heads) + tuple(p.data_ptr() for p in heads)
        if self.fuse_layers and m.cfg.pi05:  # the adaRMS stack and the output head come from the fused weights
            version += (self._fw.generation,)
        key = (tuple(times), batch if not self.fused else 0, device)
        entry = self._consts.get(key)
        if entry is not None and entry["version"] == version:
            return entry["inputs"]
        w, h = m.action_in_proj.weight.shape[0], m.cfg.action_horizon
        dtype = m.action_in_proj.weight.dtype
        ts = torch.tensor(times, dtype=torch.float32, device=device)
        emb = posemb_sincos(ts, w).to(dtype)  # (S, W)
        if m.cfg.pi05 and self.fuse_layers:
            new = [self._pi05_step_consts(m.time_condition(t[None])) for t in ts]
        elif m.cfg.pi05:  # as in PI0Model.time_condition, one (1, W) condition per Euler time
            new = [m.time_condition(t[None]) for t in ts]
        elif self.fused:
            w_x, w_t, bias = fold_action_time_mlp(*(p.detach() for p in heads))
            new = [F.linear(e, w_t) + bias for e in emb]  # S x (W,)
            new.append(w_x)
        else:
            new = [e[None, None].expand(batch, h, -1).contiguous() for e in emb]  # S x (B, Ha, W)
        if entry is None:
            entry = self._consts[key] = {"inputs": new}
        else:  # in place: captured graphs keep pointing at these tensors
            _copy_into(entry["inputs"], new)
        entry["version"] = version
        return entry["inputs"]

    def _pi05_step_consts(self, cond: torch.Tensor) -> tuple[tuple, torch.Tensor, torch.Tensor]:
        """pi0.5, one Euler time's adaRMS condition (1, W) -> (per layer (input, post-attention) modulations
        (1 + scale, shift, gate) (1, 1, D), action_out_proj weight (A, W) and bias (A,) with the final adaRMS
        norm folded in: W ((1 + s) n + h) + b = (W diag(1 + s)) n + (W h + b), float64 products rounded once)."""
        m, fw = self.model, self._fw
        mods = adarms_modulations(fw.ada, cond, m.compute_dtype, m.cfg.action_expert.width)
        layer_mods = tuple((mods[2 * i], mods[2 * i + 1]) for i in range(len(fw.expert)))
        scale1, shift, _ = mods[-1]  # the final norm's gate is unused (as in PaliGemmaWithExpert.forward)
        w = fw.out_w.double()
        out_w = (w * scale1.double().view(1, -1)).to(fw.out_w.dtype)
        out_b = (w @ shift.double().view(-1) + fw.out_b.double()).to(fw.out_b.dtype)
        return layer_mods, out_w, out_b

    def _split(self, time_inputs: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(W_x (W, A) when fused else None, the per-step time inputs)."""
        return (time_inputs[-1], time_inputs[:-1]) if self.fused else (None, time_inputs)

    # ------------------------------------------------------------------ prefix
    def _vision_and_joint(self) -> tuple[Any, Any]:
        """(SigLIP embed_image, joint transformer forward: the fused prefix pass with ``fuse_layers``), compiled when
        ``compile_prefix``."""
        if self._prefix_fns is None:
            pwe = self.model.paligemma_with_expert
            joint = self._fused_prefix if self.fuse_layers else pwe.forward
            if self.compile_prefix:
                self._prefix_fns = (torch.compile(pwe.embed_image, backend=self.backend, dynamic=False),
                                    torch.compile(joint, backend=self.backend, dynamic=False))
            else:
                self._prefix_fns = (pwe.embed_image, joint)
        return self._prefix_fns

    def embed_prefix(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                     lang_masks: torch.Tensor, live_cameras: tuple[int, ...] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``PI0Model.embed_prefix`` with every live camera in ONE SigLIP pass (weights read once, not per camera).

        Images C x (B,3,S,S), masks C x (B,), tokens/masks (B,L) -> embs (B,Tp,D), pad (B,Tp), ar (Tp,).
        ``live_cameras``: the indices of the cameras to encode, decided beforehand (:meth:`plan`; no host sync
        here); None reads the masks (a camera masked in every sample is skipped).
        """
        m = self.model
        if not self.batch_cameras:
            return m.embed_prefix(images, img_masks, lang_tokens, lang_masks)
        pwe = m.paligemma_with_expert
        if live_cameras is None:  # all-masked cameras skipped
            live = [(img, mask) for img, mask in zip(images, img_masks) if bool(mask.any())]
        else:
            live = [(images[i], img_masks[i]) for i in live_cameras]
        embs, pads = [], []
        if live:
            b = live[0][0].shape[0]
            tok = self._vision_and_joint()[0](torch.cat([img for img, _ in live]))  # (C*B, P, D)
            for c, (_, mask) in enumerate(live):
                embs.append(tok[c * b:(c + 1) * b])
                pads.append(mask.bool()[:, None].expand(-1, tok.shape[1]))
        embs.append(pwe.embed_language(lang_tokens))
        pads.append(lang_masks.bool())
        emb, pad = torch.cat(embs, 1), torch.cat(pads, 1)
        return emb, pad, torch.zeros(emb.shape[1], dtype=torch.bool, device=emb.device)

    def plan(self, img_masks: list[torch.Tensor], lang_masks: torch.Tensor, multiple: int = 1
             ) -> tuple[tuple[int, ...], int]:
        """The call's data-dependent shape choices, read on the host in one device-to-host copy: (indices of the
        cameras some sample sees, prompt columns to keep: ``trim_prompt_padding``'s length at ``multiple``)."""
        cams = (torch.stack([mk.bool().any() for mk in img_masks]) if img_masks
                else lang_masks.new_zeros(0, dtype=torch.bool))  # (C,)
        flags = torch.cat([cams.bool(), lang_masks.bool().any(0)]).cpu()  # (C + L,)
        live = tuple(i for i in range(len(img_masks)) if bool(flags[i]))
        if not self.batch_cameras:  # PI0Model.embed_prefix reads the masks itself
            live = tuple(range(len(img_masks)))
        cols, length = flags[len(img_masks):], lang_masks.shape[1]
        if not self.trim_prompt:
            return live, length
        idx = torch.nonzero(cols)
        keep = max(int(idx[-1]) + 1, 1) if idx.numel() else 1
        return live, min(round_up(keep, multiple), length)

    def encode(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
               lang_masks: torch.Tensor, state: torch.Tensor, value: bool = False,
               plan: tuple[tuple[int, ...], int] | None = None) -> _Buffers | tuple[_Buffers, torch.Tensor]:
        """Prefix + state token in one pass -> static buffers holding their KV cache (B, C, K, H) per layer
        [, with ``value``: the value head's V (B,) of this pass (pi0: the state token's output; pi0.5: the mean
        valid prefix output, as ``PI0Model.value_from``)]. ``plan`` (:meth:`plan`): live cameras and prompt
        length decided beforehand, so that this pass never synchronises with the host (a whole-call CUDA graph)."""
        m = self.model
        live = None
        if plan is not None:
            live, keep = plan
            lang_tokens, lang_masks = lang_tokens[:, :keep], lang_masks[:, :keep]
        elif self.trim_prompt:
            lang_tokens, lang_masks = trim_prompt_padding(lang_tokens, lang_masks,
                                                          PROMPT_BUCKET if self.compile_prefix else 1)
        with record_function("pi0.models.siglip+embed"):
            emb, pad, ar = self.embed_prefix(images, img_masks, lang_tokens, lang_masks, live)
        with record_function("pi0.prefix"):
            b = pad.shape[0]
            if m.cfg.pi05:  # no state token: the cache is the prefix's
                full_pad, full_ar, embs = pad, ar, [emb]
            else:
                # as in openpi pi0.py embed_suffix: the state token starts its own block (ar=True) after the prefix
                state_tok = m._linear(m.state_proj, state)[:, None].to(m.compute_dtype)  # (B, 1, W)
                ones = torch.ones(b, 1, dtype=torch.bool, device=pad.device)
                full_pad, full_ar, embs = torch.cat([pad, ones], 1), torch.cat([ar, ones[0]], 0), [emb, state_tok]
            n = full_pad.shape[1]
            buf = self._get_buffers(b, round_up(n, self.cache_bucket), pad.device, m.compute_dtype)
            mask, positions = make_attn_mask(full_pad, full_ar), make_positions(full_pad)
            if self.fuse_layers:
                outs = self._vision_and_joint()[1](embs, mask, positions, buf, n, value)
            else:
                outs, cache = self._vision_and_joint()[1](embs + [None] * (2 - len(embs)), mask, positions,
                                                          return_kv_cache=True)
                for layer, (k, v) in enumerate(cache):
                    buf.k[layer][:, :n].copy_(k)
                    buf.v[layer][:, :n].copy_(v)
        buf.n_prefix = pad.shape[1]
        buf.key_valid.zero_()
        buf.key_valid[:, :n].copy_(full_pad)
        h = m.cfg.action_horizon
        cap = buf.key_valid.shape[1]
        buf.mask[:, :, :cap].copy_(buf.key_valid[:, None, :].expand(-1, h, -1))
        # as in openpi pi0.py sample_actions: suffix positions continue from sum(prefix_mask) (+1: pi0's state)
        buf.positions.copy_(full_pad.sum(-1, keepdim=True) + torch.arange(h, device=pad.device))
        if self.fuse_layers:
            g = m.cfg.paligemma
            cos, sin = rope_tables(buf.positions, g.num_heads, g.num_kv_heads, g.head_dim)
            buf.cos.copy_(cos)
            buf.sin.copy_(sin)
            buf.bias.copy_(mask_bias(buf.mask, m.compute_dtype))
        if value:
            return buf, m.value_from(outs[0], pad, outs[1] if len(outs) > 1 else None)
        return buf

    def _fused_prefix(self, embs: list[torch.Tensor], mask: torch.Tensor, positions: torch.Tensor, buf: _Buffers,
                      n: int, outputs: bool) -> list[torch.Tensor]:
        """The prefix (+ pi0's state token) pass on fused weights, keys/values written into ``buf.kv[:, :n]``.

        embs: VLM tokens (B, Tp, D) [+ state token (B, 1, W)], mask (B, T, T), positions (B, T) -> with
        ``outputs`` the final-normed outputs per expert (as ``PaliGemmaWithExpert.forward``), else [] (the last
        layer then stops after its keys/values: its attention and MLP feed nothing).
        """
        m, fw = self.model, self._fw
        g = m.cfg.paligemma
        cd = m.compute_dtype
        cos, sin = rope_tables(positions, g.num_heads, g.num_kv_heads, g.head_dim)  # (B, T, N + 2K, H)
        bias = mask_bias(mask, cd)  # (B, 1, T, T)
        stacks = [fw.vlm, fw.expert][:len(embs)]
        hs = embs
        for i in range(g.depth):
            kv = buf.kv[i][:, :n]  # (B, T, 2K, H)
            hs = fused_layer(hs, [st[i] for st in stacks], [None] * len(hs), cos, sin, kv,
                             *cache_views(kv, g.num_kv_heads), bias, g.num_heads, cd, finish=outputs or i < g.depth - 1)
        if not outputs:
            return []
        experts = m.paligemma_with_expert.experts
        return [experts[j].norm(h) for j, h in enumerate(hs)]

    def prefix_cache(self, buf: _Buffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The last encode's prefix cache (without pi0's state token), copied out of the static buffers -> (kv
        packed as ``pack_kv_cache`` (B, depth, Tp, 2K, H), pad (B, Tp)). Tp counts live cameras and the trimmed
        prompt only, so it can be shorter than ``PI0Model.encode_prefix``'s; the missing keys are masked there."""
        return self._pack_prefix(self._prefix_views(buf))

    def _prefix_views(self, buf: _Buffers) -> tuple[torch.Tensor, ...]:
        """The prefix cache where it lies in the static buffers: per layer (B, Tp, 2K, H) (fused: views; unfused:
        keys and values concatenated), then the pad (B, Tp) (a view). Returned by a whole-call graph, so that its
        copy-out (:meth:`_pack_prefix`) is the one copy of the cache."""
        n = buf.n_prefix
        if self.fuse_layers:
            layers = [t[:, :n] for t in buf.kv]
        else:
            layers = [torch.cat([k[:, :n], v[:, :n]], 2) for k, v in zip(buf.k, buf.v)]
        return (*layers, buf.key_valid[:, :n])

    @staticmethod
    def _pack_prefix(views: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_prefix_views` -> (kv (B, depth, Tp, 2K, H), pad (B, Tp)), fresh tensors."""
        return torch.stack(views[:-1], 1), views[-1].clone()

    def _get_buffers(self, b: int, cap: int, device: torch.device, dtype: torch.dtype) -> _Buffers:
        """Zero-initialised static buffers for (B, capacity) (masked slots must hold finite values)."""
        key = (b, cap, device, dtype)
        if key not in self._buffers:
            cfg = self.model.cfg
            h, kv, hd = cfg.action_horizon, cfg.paligemma.num_kv_heads, cfg.paligemma.head_dim
            depth, nh = cfg.paligemma.depth, cfg.paligemma.num_heads
            z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
            fused = self.fuse_layers
            buf = _Buffers(
                k=[] if fused else [z(b, cap, kv, hd) for _ in range(depth)],
                v=[] if fused else [z(b, cap, kv, hd) for _ in range(depth)],
                key_valid=torch.zeros(b, cap, dtype=torch.bool, device=device),
                mask=torch.ones(b, h, cap + h, dtype=torch.bool, device=device),
                positions=torch.zeros(b, h, dtype=torch.long, device=device),
                x=torch.zeros(b, h, cfg.action_dim, dtype=torch.float32, device=device))
            if fused:
                buf.kv = [z(b, cap + h, 2 * kv, hd) for _ in range(depth)]
                buf.bias = z(b, 1, h, cap + h)
                buf.cos, buf.sin = (torch.zeros(b, h, nh + 2 * kv, hd, device=device) for _ in range(2))
                views = [cache_views(t, kv) for t in buf.kv]
                buf.step_args = ([t[:, cap:] for t in buf.kv], [k for k, _ in views], [v for _, v in views],
                                 buf.bias, buf.cos, buf.sin)
            else:
                buf.step_args = (buf.k, buf.v, buf.mask, buf.positions)
            self._buffers[key] = buf
        return self._buffers[key]

    # ------------------------------------------------------------------ denoise
    def _step(self, x: torch.Tensor, time_in: torch.Tensor, w_x: torch.Tensor | None, ks: list[torch.Tensor],
              vs: list[torch.Tensor], mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One velocity evaluation of the action tokens on the static cache: x_t (B,Ha,A) -> v_t (B,Ha,A)."""
        m = self.model
        if m.cfg.pi05:  # as in PI0Model._embed_suffix_pi05; time_in is the (1, W) adaRMS condition
            hid = m._linear(m.action_in_proj, x).to(m.compute_dtype)
            (_, out), _ = m.paligemma_with_expert([None, hid], mask, positions, kv_cache=list(zip(ks, vs)),
                                                  adarms_cond=[None, time_in])
            return m._velocity(out, x.shape[1])
        if w_x is not None:  # fused: mlp_in(action_in(x) ++ e) = W_x x + c_t
            hid = F.linear(x.to(w_x.dtype), w_x) + time_in
        else:  # as in PI0Model.embed_suffix
            act = m._linear(m.action_in_proj, x)
            hid = m._linear(m.action_time_mlp_in, torch.cat([act, time_in.to(act.dtype)], -1))
        hid = m._linear(m.action_time_mlp_out, F.silu(hid)).to(m.compute_dtype)
        (_, out), _ = m.paligemma_with_expert([None, hid], mask, positions, kv_cache=list(zip(ks, vs)))
        return m._velocity(out, x.shape[1])

    def _fused_step(self, x: torch.Tensor, time_in: Any, w_x: torch.Tensor | None, kv_tail: list[torch.Tensor],
                    ks: list[torch.Tensor], vs: list[torch.Tensor], bias: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
        """:meth:`_step` on fused weights (``pi0.models.fused``): x_t (B,Ha,A) -> v_t (B,Ha,A) float32.

        kv_tail[i] (B, Ha, 2K, H): layer i's action-token cache slots; ks/vs[i] (B, K, C + Ha, H) the whole cache;
        time_in: pi0 c_t (W,) (fused projections) or posemb (B, Ha, W); pi0.5 (per-layer adaRMS modulations,
        action_out_proj weight and bias with the final adaRMS norm folded in) of this Euler time.
        """
        m, fw = self.model, self._fw
        cd = m.compute_dtype
        if m.cfg.pi05:  # as in PI0Model._embed_suffix_pi05
            layer_mods, out_w, out_b = time_in
            hid = m._linear(m.action_in_proj, x)
        else:
            layer_mods, out_w, out_b = [None] * len(fw.expert), fw.out_w, fw.out_b
            if w_x is not None:  # fused: mlp_in(action_in(x) ++ e) = W_x x + c_t
                hid = F.linear(x, w_x, time_in)
            else:  # as in PI0Model.embed_suffix
                act = m._linear(m.action_in_proj, x)
                hid = m._linear(m.action_time_mlp_in, torch.cat([act, time_in.to(act.dtype)], -1))
            hid = m._linear(m.action_time_mlp_out, F.silu(hid))
        hid = cast(hid, cd)
        nh = m.cfg.paligemma.num_heads
        for i, lay in enumerate(fw.expert):
            hid = fused_layer([hid], [lay], [layer_mods[i]], cos, sin, kv_tail[i], ks[i], vs[i], bias, nh, cd)[0]
        # the final norm folded into action_out_proj: as in PI0Model._velocity, in the head's float32
        return F.linear(rms(hid), out_w, out_b)

    def _loop(self, buf: _Buffers, time_inputs: list[torch.Tensor], dt: float) -> torch.Tensor:
        """The whole Euler loop on static buffers (what the CUDA graph captures): x (B,Ha,A) -> actions."""
        w_x, steps = self._split(time_inputs)
        x = buf.x
        for i, time_in in enumerate(steps):
            with record_function(f"pi0.denoise_step_{i}"):
                v = self._step_fn(x, time_in, w_x, *buf.step_args)
                x = x + dt * v  # as in openpi pi0.py sample_actions: x_{t+dt} = x_t + dt * v_t
        return x

    def _sde_loop(self, buf: _Buffers, time_inputs: list[torch.Tensor], num_steps: int, sde_step: int,
                  draws: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The Flow-SDE loop on static buffers: x (B,Ha,A) -> (chain (B,N+1,Ha,A), log_prob (B,Ha,A)), by
        ``flow_sde.sde_integrate`` (the eager sampler's loop) with ``draws``: the ``chain_coefficients`` of
        ``sde_step`` ("one_minus_t", "coef", "std") and its (S,B,Ha,A) N(0,1) draws "eps", one per stochastic step
        (the call's tensors, or a graph's static copies of them)."""
        w_x, steps = self._split(time_inputs)

        def velocity(k: int, x: torch.Tensor) -> torch.Tensor:
            with record_function(f"pi0.denoise_step_{k}"):
                return self._step_fn(x, steps[k], w_x, *buf.step_args)

        coefs = (draws["one_minus_t"], draws["coef"], draws["std"])
        eps = iter(draws["eps"])  # (S,B,Ha,A): one draw per stochastic step, in step order
        return sde_integrate(velocity, buf.x, num_steps, sde_step, coefs, lambda: next(eps).to(buf.x.device))

    def _replay(self, key: tuple, loop: Callable[[], Any], copy_out: Callable[[Any], Any] = clone_outputs) -> Any:
        """Run ``loop`` (tensors, or a tuple of them, from static buffers) as one CUDA graph (``self.graphs``),
        captured on first use -> ``copy_out`` of its outputs (default: clones); None if capture failed (the caller runs
        ``loop`` itself; a failed loop-only capture turns graphs off)."""
        out = self.graphs.replay(key, loop, copy_out)
        if out is None:
            whole = key[0] == "call"
            fallback = "the Euler loop graph" if whole else "the un-captured loop"
            warnings.warn(f"CUDA graph capture failed, using {fallback}: {self.graph_error}")
            if not whole:
                self.cuda_graph = False
        return out

    def _call_graph(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                    lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor, tag: tuple,
                    body: Callable[[_Buffers, dict[str, Any], torch.Tensor | None], Any], value: bool = False,
                    extra: dict[str, torch.Tensor] | None = None, copy_out: Callable[[Any], Any] = clone_outputs
                    ) -> Any:
        """The whole call (SigLIP, prefix pass, cache set-up, ``body``'s loop) as ONE CUDA graph -> ``copy_out`` of
        body's outputs (default: clones); None when capture failed (``graph_error`` says why; later calls capture the
        loop only).

        The graph of (batch, plan, ``tag``) is captured on first use and replayed after :meth:`call_fn`'s copy-in.
        """
        key, run = self.call_fn(images, img_masks, lang_tokens, lang_masks, state, noise, tag, body, value, extra)
        if key not in self.graphs:
            run()  # first call un-captured on this stream: allocates the static cache buffers outside the graph pool
        out = self._replay(key, run, copy_out)
        if out is None:
            self.graph_scope = "loop"  # capture failed: keep graphing the Euler loop alone
        return out

    def call_fn(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor, tag: tuple,
                body: Callable[[_Buffers, dict[str, Any], torch.Tensor | None], Any], value: bool = False,
                extra: dict[str, torch.Tensor] | None = None) -> tuple[tuple, Callable[[], Any]]:
        """(graph key, the whole call as a closure over static tensors), with this call's inputs copied in.

        The live cameras and the prompt bucket are read on the host first (:meth:`plan`, the call's only
        device-to-host copy); the inputs go into static tensors of that plan; the closure then runs SigLIP, the
        prefix pass, the cache set-up and ``body(buf, statics, value)`` (``statics`` holds ``extra``'s static copies,
        refreshed each call: the SDE's coefficients and draw) with no host synchronisation, as capture needs.
        """
        dev = self.model.action_in_proj.weight.device
        plan = self.plan(img_masks, lang_masks, PROMPT_BUCKET)
        live, keep = plan
        inputs = {"tokens": lang_tokens[:, :keep], "masks": lang_masks[:, :keep], "state": state, "noise": noise,
                  **{f"image{i}": images[i] for i in live}, **{f"img_mask{i}": img_masks[i] for i in live},
                  **(extra or {})}
        key = ("call", state.shape[0], plan, *tag)
        st = self.graphs.copy_in(key, inputs, dev)

        def run() -> Any:
            cams = [st.get(f"image{i}") for i in range(len(images))]
            cam_masks = [st.get(f"img_mask{i}") for i in range(len(images))]
            enc = self.encode(cams, cam_masks, st["tokens"], st["masks"], st["state"], value=value, plan=plan)
            buf, v = enc if value else (enc, None)
            buf.x.copy_(st["noise"])
            return body(buf, st, v)

        return key, run

    def _check_call(self, state: torch.Tensor, noise: torch.Tensor | None, num_steps: int) -> torch.Tensor:
        """Validate the call, drop stale CUDA graphs (weights re-allocated) -> noise (B,Ha,A)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        cfg = self.model.cfg
        shape = (state.shape[0], cfg.action_horizon, cfg.action_dim)
        if noise is None:
            noise = torch.randn(shape, device=state.device)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise must be {shape}, got {tuple(noise.shape)}")
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        if ptrs != self._param_ptrs:  # weights re-allocated (.to(), p.data = ...): captured graphs are stale
            self.graphs.clear()
            self._param_ptrs = ptrs
        if self.fuse_layers:  # fused weights follow the model's (an RL update between calls)
            if self._fw is None:
                self._fw = FusedWeights(self.model)
            else:
                self._fw.refresh()
        return noise

    @torch.no_grad()
    def sample_actions(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                       lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor | None = None,
                       num_steps: int = 10) -> torch.Tensor:
        """Same contract as ``PI0Model.sample_actions``: noise (B,Ha,A) -> actions (B,Ha,A) float32."""
        noise = self._check_call(state, noise, num_steps)
        use_graph = self._use_graph(state.device)
        time_inputs, dt = self._time_inputs(euler_times(num_steps), state.shape[0], state.device), -1.0 / num_steps
        if use_graph and self.graph_scope == "call":
            out = self._call_graph(images, img_masks, lang_tokens, lang_masks, state, noise,
                                   ("ode", num_steps, id(time_inputs[0])),
                                   lambda buf, st, v: self._loop(buf, time_inputs, dt))
            if out is not None:
                return out
        buf = self.encode(images, img_masks, lang_tokens, lang_masks, state)
        buf.x.copy_(noise)  # copy-in
        if use_graph:
            out = self._replay((id(buf), id(time_inputs[0]), "ode"), lambda: self._loop(buf, time_inputs, dt))
            if out is not None:
                return out
        return self._loop(buf, time_inputs, dt)

    @torch.no_grad()
    def sample_actions_sde(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], lang_tokens: torch.Tensor,
                           lang_masks: torch.Tensor, state: torch.Tensor, noise: torch.Tensor, num_steps: int = 10,
                           noise_level: float = 0.5, sde_step: int | None = None,
                           generator: torch.Generator | None = None, sde_kind: str = "flow_sde",
                           return_prefix: bool = False) -> dict[str, Any]:
        """Same contract and numbers as ``PI0Model.sample_actions_sde`` (float32: within 1e-5), on the cached
        prefix and static buffers: noise (B,Ha,A) -> {"actions", "chain" (B,N+1,Ha,A), "sde_step", "log_prob"
        (B,Ha,A)[, "value" (B,)][, "prefix": :meth:`prefix_cache` with ``return_prefix``]}.

        The generator is called as in eager (the step's randint when ``sde_step`` is None, then one (B,Ha,A)
        randn on the CPU), so one seed gives the same chunk on both paths. Under a CUDA graph the randn is drawn
        before the replay (no other call of the generator lies between) and one graph is captured per ``sde_step``.
        """
        times = sde_times(num_steps)
        sde_step = pick_sde_step(num_steps, sde_step, generator, sde_kind)
        noise = self._check_call(state, noise, num_steps)
        use_graph = self._use_graph(state.device)
        time_inputs = self._time_inputs(times, state.shape[0], state.device)
        want_value = bool(self.model.cfg.value_head)
        coefs = chain_coefficients(num_steps, sde_step, noise_level, noise.to(state.device, torch.float32), sde_kind)
        # the eager draws, on the CPU, one randn per stochastic step in the same order
        eps = torch.stack([torch.randn(noise.shape, generator=generator, device="cpu")
                           for _ in sde_steps(num_steps, sde_step)])
        draws = {"one_minus_t": coefs[0], "coef": coefs[1], "std": coefs[2], "eps": eps}
        if use_graph and self.graph_scope == "call":
            def body(buf: _Buffers, st: dict[str, Any], v: torch.Tensor | None) -> tuple:
                chain, log_prob = self._sde_loop(buf, time_inputs, num_steps, sde_step, st)
                # the prefix cache as views of the static buffers: copy_out below is its one copy
                return (chain, log_prob, *((v,) if v is not None else ()),
                        *(self._prefix_views(buf) if return_prefix else ()))

            n_out = 3 if want_value else 2
            copy_out = lambda out: (*clone_outputs(out[:n_out]),  # noqa: E731
                                    *((self._pack_prefix(out[n_out:]),) if return_prefix else ()))
            out = self._call_graph(images, img_masks, lang_tokens, lang_masks, state, noise,
                                   ("sde", num_steps, sde_step, want_value, return_prefix, id(time_inputs[0])), body,
                                   value=want_value, extra=draws, copy_out=copy_out)
            if out is not None:
                res = {"actions": out[0][:, -1], "chain": out[0], "sde_step": sde_step, "log_prob": out[1]}
                if return_prefix:
                    res["prefix"] = out[-1]
                return {**res, "value": out[2]} if want_value else res
        value = None
        if want_value:
            buf, value = self.encode(images, img_masks, lang_tokens, lang_masks, state, value=True)
        else:
            buf = self.encode(images, img_masks, lang_tokens, lang_masks, state)
        buf.x.copy_(noise)  # copy-in
        out = None
        if use_graph:  # the Euler loop alone as a graph, one per stochastic step, on static copies of the draws
            key = (id(buf), id(time_inputs[0]), "sde", sde_step)
            st = self.graphs.copy_in(key, draws, buf.x.device)
            out = self._replay(key, lambda: self._sde_loop(buf, time_inputs, num_steps, sde_step, st))
        if out is None:
            out = self._sde_loop(buf, time_inputs, num_steps, sde_step, draws)
        chain, log_prob = out
        res = {"actions": chain[:, -1], "chain": chain, "sde_step": sde_step, "log_prob": log_prob}
        if return_prefix:
            res["prefix"] = self.prefix_cache(buf)
        return {**res, "value": value} if value is not None else res

    __call__ = sample_actions
