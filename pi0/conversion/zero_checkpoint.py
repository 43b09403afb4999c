"""Zero-valued openpi pi0 checkpoints of any size (JAX orbax, or openpi's PyTorch format): structure and memory
tests without real weights.

``openpi_param_shapes`` lists the leaves of openpi's pi0 params tree for a ``Pi0Config`` (names as
``nnx.state`` flattens them with "/"); ``write_zero_checkpoint`` writes them as an orbax PyTree under a
top-level "params" item, as openpi stores params. Zeros compress to almost nothing on disk, and the
arrays are zero-stride views, so even the full 3.2 B-parameter tree writes in seconds with ~2 GiB RSS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from pi0.models.config import Pi0Config

Shapes = dict[str, tuple[int, ...]]


def openpi_param_shapes(cfg: Pi0Config) -> Shapes:
    """openpi leaf name -> shape for ``cfg`` (layers stacked on axis 0, as openpi's scanned modules store them)."""
    # as in openpi gemma.py (Einsum weights q (N,D,H), kv (2,K,D,H), attn_vec (N,H,D), gating (2,D,F)) and
    # big_vision vit.py (flax Dense kernels (in, out), MultiHeadDotProductAttention (W,N,H) / (N,H,W)), nnx-scanned.
    v, img, blk = cfg.vision, "PaliGemma/img/", "PaliGemma/img/Transformer/encoderblock/"
    W, L, M, N, H = v.width, v.depth, v.mlp_dim, v.num_heads, v.width // v.num_heads
    D = cfg.paligemma.width
    s: Shapes = {
        f"{img}embedding/kernel": (v.patch_size, v.patch_size, 3, W), f"{img}embedding/bias": (W,),
        f"{img}pos_embedding": (1, v.num_patches, W),
        f"{img}Transformer/encoder_norm/scale": (W,), f"{img}Transformer/encoder_norm/bias": (W,),
        f"{img}head/kernel": (W, D), f"{img}head/bias": (D,),
        f"{blk}MlpBlock_0/Dense_0/kernel": (L, W, M), f"{blk}MlpBlock_0/Dense_0/bias": (L, M),
        f"{blk}MlpBlock_0/Dense_1/kernel": (L, M, W), f"{blk}MlpBlock_0/Dense_1/bias": (L, W),
        f"{blk}MultiHeadDotProductAttention_0/out/kernel": (L, N, H, W),
        f"{blk}MultiHeadDotProductAttention_0/out/bias": (L, W),
        "PaliGemma/llm/embedder/input_embedding": (cfg.vocab_size, D),
    }
    for ln in ("LayerNorm_0", "LayerNorm_1"):
        s[f"{blk}{ln}/scale"] = s[f"{blk}{ln}/bias"] = (L, W)
    for qkv in ("query", "key", "value"):
        s[f"{blk}MultiHeadDotProductAttention_0/{qkv}/kernel"] = (L, W, N, H)
        s[f"{blk}MultiHeadDotProductAttention_0/{qkv}/bias"] = (L, N, H)
    for suffix, g in (("", cfg.paligemma), ("_1", cfg.action_expert)):
        d, n, k, h, f, depth = g.width, g.num_heads, g.num_kv_heads, g.head_dim, g.mlp_dim, g.depth
        pre = "PaliGemma/llm/layers/"
        if suffix and cfg.pi05:  # pi0.5's adaptive expert norms: Dense_0 (cond width -> 3D) instead of a scale
            s["PaliGemma/llm/final_norm_1/Dense_0/kernel"], s["PaliGemma/llm/final_norm_1/Dense_0/bias"] = (d, 3 * d), (3 * d,)
            for norm in ("pre_attention_norm_1", "pre_ffw_norm_1"):
                s[f"{pre}{norm}/Dense_0/kernel"], s[f"{pre}{norm}/Dense_0/bias"] = (depth, d, 3 * d), (depth, 3 * d)
        else:
            s[f"PaliGemma/llm/final_norm{suffix}/scale"] = (d,)
            s[f"{pre}pre_attention_norm{suffix}/scale"] = s[f"{pre}pre_ffw_norm{suffix}/scale"] = (depth, d)
        s[f"{pre}attn/q_einsum{suffix}/w"] = (depth, n, d, h)
        s[f"{pre}attn/kv_einsum{suffix}/w"] = (depth, 2, k, d, h)
        s[f"{pre}attn/attn_vec_einsum{suffix}/w"] = (depth, n, h, d)
        s[f"{pre}mlp{suffix}/gating_einsum"] = (depth, 2, d, f)
        s[f"{pre}mlp{suffix}/linear"] = (depth, f, d)
    w, a = cfg.action_expert.width, cfg.action_dim
    heads = {"action_in_proj": (a, w), "action_out_proj": (w, a)}
    if cfg.pi05:
        heads.update(time_mlp_in=(w, w), time_mlp_out=(w, w))
    else:
        heads.update(state_proj=(a, w), action_time_mlp_in=(2 * w, w), action_time_mlp_out=(w, w))
    for name, (i, o) in heads.items():
        s[f"{name}/kernel"], s[f"{name}/bias"] = (i, o), (o,)
    return dict(sorted(s.items()))


def write_zero_checkpoint(shapes: Shapes, ckpt_dir: Path, dtype: str = "bfloat16", state_dim: int = 8,
                          action_dim: int = 7, asset_id: str = "physical-intelligence/libero") -> Path:
    """Write ``<ckpt_dir>/params`` (orbax, zeros in ``dtype``) and ``<ckpt_dir>/assets/<asset_id>/norm_stats.json``."""
    import ml_dtypes
    import orbax.checkpoint as ocp

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tree: dict = {}
    for name, shape in shapes.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = np.broadcast_to(np.zeros((), np_dtype), shape)  # zero-stride: no memory
    # orbax deep-copies host arrays by default (materialising every zero-stride view); this writer owns them.
    ocp.type_handlers.register_type_handler(np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False),
                                            override=True)
    params = Path(ckpt_dir) / "params"
    shutil.rmtree(params, ignore_errors=True)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(save_concurrent_gb=1))
    ckptr.save(str(params.resolve()), ocp.args.PyTreeSave({"params": tree}))
    stats = {k: {"mean": [0.0] * n, "std": [1.0] * n, "q01": [-1.0] * n, "q99": [1.0] * n}
             for k, n in (("state", state_dim), ("actions", action_dim))}
    assets = Path(ckpt_dir) / "assets" / asset_id
    assets.mkdir(parents=True, exist_ok=True)
    (assets / "norm_stats.json").write_text(json.dumps({"norm_stats": stats}))
    return params


def openpi_pytorch_shapes(cfg: Pi0Config) -> Shapes:
    """openpi-PyTorch key -> shape for ``cfg``: openpi's JAX tree (``openpi_param_shapes``) through the JAX key map
    (``pi0.conversion.pi0.plan_conversion``) and ``ours_to_openpi``, plus the action expert's unused ``lm_head``."""
    from pi0.conversion.foreign_keys import O_EXPERT_HEAD, ours_to_openpi
    from pi0.conversion.pi0 import plan_conversion

    view = {k: np.broadcast_to(np.zeros((), np.float32), s) for k, s in openpi_param_shapes(cfg).items()}
    out = {ours_to_openpi(t): shape for outs in plan_conversion(view, cfg).values() for t, shape in outs}
    out[O_EXPERT_HEAD] = (cfg.vocab_size, cfg.action_expert.width)
    return dict(sorted(out.items()))


def write_zero_openpi_pytorch(cfg: Pi0Config, ckpt_dir: Path, dtype: str = "bfloat16", state_dim: int = 8,
                              action_dim: int = 7, asset_id: str = "physical-intelligence/libero") -> Path:
    """Write ``cfg``'s openpi-PyTorch checkpoint as zeros: ``model.safetensors`` (a sparse file: the header, then
    nothing written, so a full-size model takes a few KB of disk and no memory), openpi's ``config.json`` and
    ``assets/<asset_id>/norm_stats.json``."""
    import torch

    from pi0.conversion.foreign_keys import O_EMBED, O_LM_HEAD
    from pi0.utils.checkpoint_io import SafetensorsWriter

    ckpt_dir = Path(ckpt_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    (ckpt_dir / "assets" / asset_id).mkdir(parents=True)
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    shapes = openpi_pytorch_shapes(cfg)
    with SafetensorsWriter(ckpt_dir / "model.safetensors", {k: (tdtype, s) for k, s in shapes.items()},
                           metadata={O_EMBED: O_LM_HEAD}) as w:
        for k in shapes:
            w.write_zeros(k)
    (ckpt_dir / "config.json").write_text(json.dumps({
        "action_dim": cfg.action_dim, "action_horizon": cfg.action_horizon, "paligemma_variant": cfg.paligemma.variant,
        "action_expert_variant": cfg.action_expert.variant, "precision": dtype}, indent=2))
    stats = {k: {"mean": [0.0] * n, "std": [1.0] * n, "q01": [-1.0] * n, "q99": [1.0] * n}
             for k, n in (("state", state_dim), ("actions", action_dim))}
    (ckpt_dir / "assets" / asset_id / "norm_stats.json").write_text(json.dumps({"norm_stats": stats}))
    return ckpt_dir
