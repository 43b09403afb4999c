"""openpi pi0-FAST params (flat name -> array) -> ``PI0FASTModel`` state dict, strictly; and the checkpoint driver.

A pi0-FAST tree is PaliGemma alone: ``PaliGemma/img/...`` (SigLIP + head) and ``PaliGemma/llm/...``
(one Gemma, no ``_1`` expert, no action projections). Layers are scanned (leading depth axis).
``convert_pi0_to_hf_lerobot.py`` dispatches here when ``is_pi0fast_tree`` holds.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pi0.config import GEMMA_VARIANTS, SIGLIP_VARIANTS, GemmaConfig, SiglipConfig
from pi0.errors import MissingPathError

log = logging.getLogger(__name__)

Flat = dict[str, np.ndarray]
Rule = Callable[[np.ndarray], Iterator[tuple[str, np.ndarray]]]
IMG, LLM = "PaliGemma/img/", "PaliGemma/llm/"
VT = "paligemma.vision_tower.vision_model."
LM = "paligemma.language_model.model."


def is_pi0fast_tree(keys: Any) -> bool:
    """True for openpi pi0-FAST parameter names: a PaliGemma LLM without the ``_1`` expert or action heads."""
    keys = [k.removeprefix("params/") for k in keys]
    has_llm = any(k.startswith(LLM) for k in keys)
    has_expert = any((k.startswith(LLM) and "_1" in k) or k.startswith(("action_", "state_proj")) for k in keys)
    return has_llm and not has_expert


def _variant(table: dict[str, tuple], sizes: tuple) -> str:
    """Name of the variant with exactly these sizes, else 'custom'."""
    return next((n for n, v in table.items() if tuple(v) == sizes), "custom")


def infer_fast_config(flat: Flat, **overrides: Any):
    """Pi0FASTConfig from parameter shapes; ``overrides`` (Pi0FASTConfig fields) win."""
    from pi0.modeling_pi0fast import Pi0FASTConfig

    try:
        kernel = flat[f"{IMG}embedding/kernel"]  # (p, p, 3, W)
        patch, width = kernel.shape[0], kernel.shape[3]
        blk = f"{IMG}Transformer/encoderblock/"
        v_sizes = (width, flat[f"{blk}LayerNorm_0/scale"].shape[0], flat[f"{blk}MlpBlock_0/Dense_0/kernel"].shape[-1],
                   flat[f"{blk}MultiHeadDotProductAttention_0/query/kernel"].shape[2])
        base = _variant(SIGLIP_VARIANTS, v_sizes)
        vision = SiglipConfig(*v_sizes, patch_size=patch,
                              image_size=math.isqrt(flat[f"{IMG}pos_embedding"].shape[1]) * patch,
                              variant=f"{base}/{patch}" if base != "custom" else "custom")
        q = flat[f"{LLM}layers/attn/q_einsum/w"]  # (L, N, D, H)
        kv = flat.get(f"{LLM}layers/attn/kv_einsum/w")
        depth, heads, d, head_dim = q.shape
        g_sizes = (d, depth, flat[f"{LLM}layers/mlp/gating_einsum"].shape[-1], heads,
                   kv.shape[2] if kv is not None else heads, head_dim)
        gemma = GemmaConfig(*g_sizes, variant=_variant(GEMMA_VARIANTS, g_sizes))
        vocab = flat[f"{LLM}embedder/input_embedding"].shape[0]
    except KeyError as e:
        raise ValueError(f"not a pi0-FAST checkpoint: missing parameter {e.args[0]!r}") from e
    return Pi0FASTConfig(**{**dict(paligemma=gemma, vision=vision, vocab_size=vocab), **overrides})


def _rules() -> dict[str, Rule]:
    """openpi key -> fn(array) yielding (torch key, array) pairs."""
    blk, lay, gl = f"{IMG}Transformer/encoderblock/", VT + "encoder.layers.{}.", LM + "layers.{}."
    one = lambda name, f=lambda a: a: lambda a: iter([(name, f(a))])  # noqa: E731
    each = lambda name, f=lambda a: a, fmt=lay: (  # noqa: E731 - one torch key per scanned layer
        lambda a: ((fmt.format(i) + name, f(x)) for i, x in enumerate(a)))
    r: dict[str, Rule] = {
        f"{IMG}embedding/kernel": one(VT + "embeddings.patch_embedding.weight", lambda a: a.transpose(3, 2, 0, 1)),
        f"{IMG}embedding/bias": one(VT + "embeddings.patch_embedding.bias"),
        f"{IMG}pos_embedding": one(VT + "embeddings.position_embedding.weight", lambda a: a[0]),
        f"{IMG}Transformer/encoder_norm/scale": one(VT + "post_layernorm.weight"),
        f"{IMG}Transformer/encoder_norm/bias": one(VT + "post_layernorm.bias"),
        f"{IMG}head/kernel": one("paligemma.multi_modal_projector.linear.weight", lambda a: a.T),
        f"{IMG}head/bias": one("paligemma.multi_modal_projector.linear.bias"),
        f"{LLM}embedder/input_embedding": one(LM + "embed_tokens.weight"),
        f"{LLM}final_norm/scale": one(LM + "norm.weight"),
        f"{LLM}layers/pre_attention_norm/scale": each("input_layernorm.weight", fmt=gl),
        f"{LLM}layers/pre_ffw_norm/scale": each("post_attention_layernorm.weight", fmt=gl),
        # (N, D, H) -> (N*H, D)
        f"{LLM}layers/attn/q_einsum/w": each("self_attn.q_proj.weight",
                                             lambda w: w.transpose(0, 2, 1).reshape(-1, w.shape[1]), gl),
        # (N, H, D) -> (D, N*H)
        f"{LLM}layers/attn/attn_vec_einsum/w": each("self_attn.o_proj.weight",
                                                    lambda w: w.reshape(-1, w.shape[-1]).T, gl),
        f"{LLM}layers/mlp/linear": each("mlp.down_proj.weight", lambda w: w.T, gl),
    }
    for flax, ours in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
        r[f"{blk}{flax}/scale"], r[f"{blk}{flax}/bias"] = each(ours + ".weight"), each(ours + ".bias")
    for flax, ours in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
        r[f"{blk}MlpBlock_0/{flax}/kernel"] = each(f"mlp.{ours}.weight", lambda a: a.T)
        r[f"{blk}MlpBlock_0/{flax}/bias"] = each(f"mlp.{ours}.bias")
    mha = f"{blk}MultiHeadDotProductAttention_0/"
    for flax, ours in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        r[f"{mha}{flax}/kernel"] = each(f"self_attn.{ours}.weight", lambda a: a.reshape(a.shape[0], -1).T)  # (W,N,H)
        r[f"{mha}{flax}/bias"] = each(f"self_attn.{ours}.bias", lambda a: a.reshape(-1))
    r[f"{mha}out/kernel"] = each("self_attn.out_proj.weight", lambda a: a.reshape(-1, a.shape[-1]).T)  # (N,H,W)
    r[f"{mha}out/bias"] = each("self_attn.out_proj.bias")

    def kv(a: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:  # (L, 2, K, D, H) -> k, v (K*H, D) per layer
        for i, w in enumerate(a):
            for j, n in enumerate("kv"):
                yield gl.format(i) + f"self_attn.{n}_proj.weight", w[j].transpose(0, 2, 1).reshape(-1, w.shape[2])

    def qkv(a: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:  # (L, 3, N, D, H) when num_kv_heads == num_heads
        for i, w in enumerate(a):
            for j, n in enumerate("qkv"):
                yield gl.format(i) + f"self_attn.{n}_proj.weight", w[j].transpose(0, 2, 1).reshape(-1, w.shape[2])

    def gating(a: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:  # (L, 2, D, F) -> gate, up (F, D)
        for i, w in enumerate(a):
            yield gl.format(i) + "mlp.gate_proj.weight", w[0].T
            yield gl.format(i) + "mlp.up_proj.weight", w[1].T

    r[f"{LLM}layers/attn/kv_einsum/w"] = kv
    r[f"{LLM}layers/attn/qkv_einsum/w"] = qkv
    r[f"{LLM}layers/mlp/gating_einsum"] = gating
    return r


def convert_fast_params(flat: Flat, expected: dict[str, tuple[int, ...]] | None = None) -> Flat:
    """openpi pi0-FAST flat params -> ``PI0FASTModel`` state dict; unknown / unused / mis-shaped keys raise."""
    rules = _rules()
    flat = {k.removeprefix("params/").removesuffix("/value"): v for k, v in flat.items()}
    unknown = sorted(k for k in flat if k not in rules)
    if unknown:
        raise ValueError(f"unknown openpi parameter(s) {unknown[:10]} (total {len(unknown)}) for a pi0-FAST "
                         f"checkpoint (LoRA weights or another model?)")
    out: Flat = {}
    for key, arr in flat.items():
        for tkey, t in rules[key](np.asarray(arr)):
            if tkey in out:
                raise ValueError(f"torch key {tkey} produced twice (second time from {key})")
            out[tkey] = np.ascontiguousarray(t)
    if expected is not None:
        unused, extra = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
        if unused or extra:
            raise ValueError(f"checkpoint/model mismatch: model keys never set {unused[:10]}; converted keys the "
                             f"model lacks {extra[:10]}")
        for k, shape in expected.items():
            if tuple(out[k].shape) != tuple(shape):
                raise ValueError(f"shape mismatch for {k}: converted {tuple(out[k].shape)} vs model {tuple(shape)}")
    return out


def build_fast_model(flat: Flat, **overrides: Any):
    """Flat openpi params -> a float32 ``PI0FASTModel`` holding them (config inferred from shapes)."""
    from pi0.modeling_pi0fast import PI0FASTModel

    cfg = infer_fast_config({k.removeprefix("params/").removesuffix("/value"): v for k, v in flat.items()},
                            **overrides)
    with torch.device("meta"):
        model = PI0FASTModel(cfg)
    state = convert_fast_params(flat, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for k, t in model.state_dict().items():
            t.copy_(torch.from_numpy(np.array(state[k], dtype=np.float32)))
    return model.float().eval()


def convert_pi0fast_checkpoint(flat: Flat, output_path: str | Path, norm_stats_path: str | Path,
                               tokenizer: str | Path | None = None, fast_tokenizer: str | Path | None = None,
                               dtype: str = "float32", delta_action_dims: int = 0, **overrides: Any) -> Path:
    """Write a ``PI0FASTPolicy`` directory from already-read flat params (atomically: temp dir + rename)."""
    from pi0.fast_tokenizer import FASTTokenizer
    from pi0.normalize import load_norm_stats
    from pi0.policy_pi0fast import FASTPolicyConfig, PI0FASTPolicy
    from pi0.tokenizer import build_tokenizer_model

    stats = load_norm_stats(norm_stats_path)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise MissingPathError(f"--tokenizer {tokenizer} does not exist")
    fast = FASTTokenizer.from_pretrained(fast_tokenizer) if fast_tokenizer else None
    overrides.setdefault("action_dim", stats["actions"].dim)
    model = build_fast_model(flat, **overrides)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_path.name}.", dir=output_path.parent))
    try:
        if tokenizer is None:
            log.warning("no --tokenizer: writing the small offline stand-in; pass PaliGemma's sentencepiece model")
            tokenizer = build_tokenizer_model(tmp / "tokenizer.model")
        if fast is None:
            log.warning("no --fast_tokenizer: fitting a stand-in FAST tokenizer on synthetic chunks; pass the "
                        "tokenizer the checkpoint was trained with for real use")
        pol_cfg = FASTPolicyConfig(model=model.cfg, delta_action_dims=delta_action_dims)
        policy = PI0FASTPolicy.build(pol_cfg, stats, tokenizer, fast, model)
        policy.save_pretrained(tmp, dtype=dtype)
        if output_path.exists():
            shutil.rmtree(output_path)
        tmp.chmod(0o755)
        tmp.rename(output_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_path


def orbax_param_names(params_dir: str | Path) -> list[str]:
    """Parameter names of an orbax ``<ckpt>/params`` from its metadata only (no array is read)."""
    import orbax.checkpoint as ocp

    md = ocp.PyTreeCheckpointer().metadata(str(Path(params_dir).resolve()))
    tree = getattr(md, "item_metadata", md)
    tree = getattr(tree, "tree", tree)

    def walk(t: Any, prefix: str) -> Iterator[str]:
        if isinstance(t, dict):
            for k, v in t.items():
                yield from walk(v, f"{prefix}{k}/")
        else:
            yield prefix[:-1].removesuffix("/value")

    return [k.removeprefix("params/") for k in walk(tree, "")]


def maybe_convert_pi0fast(checkpoint_dir: str | Path, output_path: str | Path, norm_stats: str | Path | None = None,
                          tokenizer: str | Path | None = None, fast_tokenizer: str | Path | None = None,
                          dtype: str = "float32", delta_action_dims: int | None = None,
                          **overrides: Any) -> Path | None:
    """Convert ``checkpoint_dir`` if it holds a pi0-FAST tree (-> output path), else return None (not ours).

    Norm stats and delta actions are found exactly as for pi0 (``pi0.conversion``): an unknown asset id
    needs ``--delta_action_dims``.
    """
    from pi0.conversion import find_norm_stats, read_orbax_params, resolve_delta_action_dims

    params_dir = Path(checkpoint_dir)
    if not params_dir.is_dir():
        return None  # the pi0 converter reports a missing directory
    if not (params_dir / "_METADATA").exists() and (params_dir / "params" / "_METADATA").exists():
        params_dir = params_dir / "params"
    if not (params_dir / "_METADATA").exists() or not is_pi0fast_tree(orbax_param_names(params_dir)):
        return None
    ns = Path(norm_stats) if norm_stats else find_norm_stats(params_dir)
    if ns is None or not ns.is_file():
        raise MissingPathError(f"no norm_stats.json under {params_dir.resolve().parent}/assets/*/; "
                               f"pass --norm_stats PATH")
    if fast_tokenizer is not None and not Path(fast_tokenizer).is_dir():
        raise MissingPathError(f"--fast_tokenizer {fast_tokenizer} is not a directory (processor_config.json + "
                               f"tokenizer.json)")
    delta_action_dims = resolve_delta_action_dims(ns, delta_action_dims)
    log.info("pi0-FAST parameter tree detected in %s", params_dir)
    return convert_pi0fast_checkpoint(read_orbax_params(params_dir), output_path, ns, tokenizer, fast_tokenizer,
                                      dtype, delta_action_dims=delta_action_dims, **overrides)
