"""openpi JAX pi0 / pi0.5 checkpoint (orbax params) -> PyTorch ``PI0Policy`` directory, with a strict key map.

A pi0.5 tree (``time_mlp_in``, adaptive expert norms) is detected from its keys and needs ``--openpi_config``.

The key map is a pure function of numpy arrays (``convert_params``). ``convert_checkpoint`` streams:
it reads only the orbax metadata to infer the config and check every key and shape (``plan_conversion``),
writes the safetensors header, then restores a few leaves at a time (orbax partial restore), maps, splits
the stacked layers, casts and writes each tensor, so peak memory is about one leaf group, not the model.
Reading orbax needs the optional ``convert`` extra (CPU JAX + orbax-checkpoint).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pi0.conversion.openpi_configs import get_openpi_config, names_for
from pi0.errors import MissingPathError, PathExistsError, UserError
from pi0.models.config import GEMMA_VARIANTS, SIGLIP_VARIANTS, GemmaConfig, Pi0Config, SiglipConfig
from pi0.models.pi0 import PI0Model, param_storage_dtype
from pi0.policies.normalize import load_norm_stats, save_norm_stats
from pi0.policies.pi0 import PI0Policy, PolicyConfig
from pi0.policies.tokenizer import PaligemmaTokenizer, build_tokenizer_model
from pi0.utils.checkpoint_io import SafetensorsWriter, atomic_directory

log = logging.getLogger(__name__)

Flat = dict[str, np.ndarray]
VT = "paligemma_with_expert.paligemma.vision_tower.vision_model."
MMP = "paligemma_with_expert.paligemma.multi_modal_projector.linear."
GEMMA_PREFIX = ("paligemma_with_expert.paligemma.language_model.model.", "paligemma_with_expert.gemma_expert.model.")
HEADS = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out",
         "time_mlp_in", "time_mlp_out")  # the last two: pi0.5


# ---------------------------------------------------------------------------------------------- reading
def flatten_tree(tree: dict[str, Any], prefix: str = "") -> Flat:
    """Nested dict -> {"a/b/c": np.ndarray}; a trailing "value" level (nnx State) is stripped."""
    out: Flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_tree(v, f"{prefix}{k}/"))
        else:
            key = f"{prefix}{k}"
            out[key.removesuffix("/value")] = np.asarray(v)
    return out


def _resolve_params_dir(params_dir: str | Path) -> Path:
    """openpi's ``<ckpt>/params`` (or ``<ckpt>``) -> the orbax directory holding _METADATA."""
    params_dir = Path(params_dir)
    if not params_dir.is_dir():
        raise MissingPathError(f"openpi params directory {params_dir} does not exist (pass <ckpt>/params)")
    if not (params_dir / "_METADATA").exists() and (params_dir / "params" / "_METADATA").exists():
        params_dir = params_dir / "params"
    if not (params_dir / "_METADATA").exists():
        raise MissingPathError(f"{params_dir} is not an orbax checkpoint (no _METADATA); pass <ckpt>/params")
    return params_dir.resolve()


class OrbaxParams:
    """Lazy view of openpi's params checkpoint: shapes/dtypes from metadata, arrays restored on demand."""

    def __init__(self, params_dir: str | Path):
        params_dir = _resolve_params_dir(params_dir)
        try:
            import orbax.checkpoint as ocp
        except ImportError as e:
            raise ImportError("reading openpi checkpoints needs the optional extra: pip install -e '.[convert]' "
                              "(CPU jax + orbax-checkpoint)") from e
        self._ocp, self.path = ocp, params_dir
        self._ckptr = ocp.PyTreeCheckpointer()
        meta = self._ckptr.metadata(str(params_dir))
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        self.paths: dict[str, tuple[str, ...]] = {}  # flat openpi key -> path in the saved tree
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}

        def walk(node: Any, path: tuple[str, ...]) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, path + (k,))
                return
            keys = path[1:] if path[:1] == ("params",) else path
            key = "/".join(keys).removesuffix("/value")
            if getattr(node, "shape", None) is None:
                raise ValueError(f"{params_dir}: leaf {key!r} is not an array ({type(node).__name__}); "
                                 f"is this openpi's <ckpt>/params?")
            self.paths[key], self.shapes[key] = path, tuple(node.shape)
            self.dtypes[key] = np.dtype(node.dtype)

        walk(tree, ())

    def shape_view(self) -> Flat:
        """{key: zero-stride array of the leaf's shape}: what ``infer_config`` / the key rules need, ~0 bytes."""
        return {k: np.broadcast_to(np.zeros((), self.dtypes[k]), s) for k, s in self.shapes.items()}

    def read(self, keys: list[str], dtypes: dict[str, Any] | None = None) -> Flat:
        """Restore only ``keys`` (orbax partial restore) as numpy arrays, in their stored dtype or ``dtypes[key]``.

        A cast in ``dtypes`` happens inside tensorstore while reading (float32 -> bfloat16 rounds to nearest
        even, bit-identical to torch's cast), so a float32 leaf never needs a float32 buffer of its own.
        """
        item: dict[str, Any] = {}
        args: dict[str, Any] = {}
        for key in keys:
            node_i, node_a, path = item, args, self.paths[key]
            for part in path[:-1]:
                node_i, node_a = node_i.setdefault(part, {}), node_a.setdefault(part, {})
            node_i[path[-1]] = 0
            node_a[path[-1]] = self._ocp.RestoreArgs(restore_type=np.ndarray, dtype=(dtypes or {}).get(key))
        restored = self._ckptr.restore(str(self.path), args=self._ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
        out: Flat = {}
        for key in keys:
            node = restored
            for part in self.paths[key]:
                node = node[part]
            out[key] = np.asarray(node)
        return out


def read_orbax_params(params_dir: str | Path) -> Flat:
    """Read openpi's whole ``<ckpt>/params`` orbax PyTree -> flat {openpi key: float32/bf16 array}."""
    src = OrbaxParams(params_dir)
    return src.read(list(src.shapes))


# ---------------------------------------------------------------------------------------------- config
def _match(table: dict[str, tuple], values: tuple) -> str:
    """Name of the variant in ``table`` with exactly these sizes, else 'custom'."""
    return next((name for name, v in table.items() if tuple(v) == values), "custom")


def gemma_config_from(flat: Flat, s: str) -> GemmaConfig:
    """Gemma sizes from one expert's tensors (suffix s = '' or '_1')."""
    a = "PaliGemma/llm/layers/attn/"
    q = flat[f"{a}q_einsum{s}/w"]  # (L, N, D, H)
    if f"{a}kv_einsum{s}/w" in flat:
        kv_heads = flat[f"{a}kv_einsum{s}/w"].shape[2]
    else:
        kv_heads = q.shape[1]
    depth, heads, width, head_dim = q.shape
    mlp = flat[f"PaliGemma/llm/layers/mlp{s}/gating_einsum"].shape[-1]
    sizes = (width, depth, mlp, heads, kv_heads, head_dim)
    return GemmaConfig(*sizes, variant=_match(GEMMA_VARIANTS, sizes))


def is_pi05_tree(keys: Any) -> bool:
    """True for an openpi pi0.5 params tree (time_mlp_in / adaRMS norms instead of state_proj / action_time_mlp)."""
    return any(k.removeprefix("params/").startswith("time_mlp_in/") for k in keys)


def siglip_config_from(flat: Flat) -> SiglipConfig:
    """SigLIP sizes (and the variant name, when they match one) from the vision tower's tensors."""
    img = "PaliGemma/img/"
    kernel = flat[f"{img}embedding/kernel"]  # (p, p, 3, W)
    patch, width = kernel.shape[0], kernel.shape[3]
    n_pos = flat[f"{img}pos_embedding"].shape[1]
    blk = f"{img}Transformer/encoderblock/"
    depth = flat[f"{blk}LayerNorm_0/scale"].shape[0]
    mlp = flat[f"{blk}MlpBlock_0/Dense_0/kernel"].shape[-1]
    heads = flat[f"{blk}MultiHeadDotProductAttention_0/query/kernel"].shape[2]
    base = _match(SIGLIP_VARIANTS, (width, depth, mlp, heads))
    return SiglipConfig(width, depth, mlp, heads, patch_size=patch, image_size=int(math.isqrt(n_pos)) * patch,
                        variant=f"{base}/{patch}" if base != "custom" else "custom")


def infer_config(flat: Flat, **overrides: Any) -> Pi0Config:
    """Full Pi0Config from parameter shapes; ``overrides`` win (Pi0Config fields, or variant names
    ``paligemma_variant`` / ``action_expert_variant`` / ``vision_variant``)."""
    try:
        vision = siglip_config_from(flat)
        vocab = flat["PaliGemma/llm/embedder/input_embedding"].shape[0]
        cfg = dict(paligemma=gemma_config_from(flat, ""), action_expert=gemma_config_from(flat, "_1"), vision=vision,
                   vocab_size=vocab, action_dim=flat["action_in_proj/kernel"].shape[0],
                   pi05=is_pi05_tree(flat))
    except KeyError as e:
        raise ValueError(f"not a pi0 checkpoint: missing parameter {e.args[0]!r}") from e
    for key, build in (("paligemma", GemmaConfig.from_variant), ("action_expert", GemmaConfig.from_variant),
                       ("vision", lambda name: SiglipConfig.from_variant(name, vision.image_size))):
        name = overrides.pop(f"{key}_variant", None)
        if name is not None:
            cfg[key] = build(name)
    cfg.update(overrides)
    return Pi0Config(**cfg)


# ---------------------------------------------------------------------------------------------- key map
def _dense(kernel: np.ndarray) -> np.ndarray:
    """flax Dense kernel (in, out) -> torch Linear weight (out, in)."""
    return kernel.T


def siglip_rules() -> Iterator[tuple[str, Callable[[np.ndarray], Iterator[tuple[str, np.ndarray]]]]]:
    """(openpi key, fn(array) -> (torch key, array)...) for the vision tower and projector."""
    img, blk, lay = "PaliGemma/img/", "PaliGemma/img/Transformer/encoderblock/", VT + "encoder.layers.{}."
    one = lambda name, f=lambda a: a: lambda a: iter([(name, f(a))])  # noqa: E731
    per_layer = lambda name, f=lambda a: a: lambda a: ((name.format(i), f(x)) for i, x in enumerate(a))  # noqa
    yield f"{img}embedding/kernel", one(VT + "embeddings.patch_embedding.weight", lambda a: a.transpose(3, 2, 0, 1))
    yield f"{img}embedding/bias", one(VT + "embeddings.patch_embedding.bias")
    yield f"{img}pos_embedding", one(VT + "embeddings.position_embedding.weight", lambda a: a[0])
    yield f"{img}Transformer/encoder_norm/scale", one(VT + "post_layernorm.weight")
    yield f"{img}Transformer/encoder_norm/bias", one(VT + "post_layernorm.bias")
    yield f"{img}head/kernel", one(MMP + "weight", _dense)
    yield f"{img}head/bias", one(MMP + "bias")
    for flax, ours in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
        yield f"{blk}{flax}/scale", per_layer(lay + ours + ".weight")
        yield f"{blk}{flax}/bias", per_layer(lay + ours + ".bias")
    for flax, ours in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
        yield f"{blk}MlpBlock_0/{flax}/kernel", per_layer(lay + f"mlp.{ours}.weight", _dense)
        yield f"{blk}MlpBlock_0/{flax}/bias", per_layer(lay + f"mlp.{ours}.bias")
    mha = f"{blk}MultiHeadDotProductAttention_0/"
    for flax, ours in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        # (W, N, H) -> (N*H, W)
        yield f"{mha}{flax}/kernel", per_layer(lay + f"self_attn.{ours}.weight", lambda a: a.reshape(a.shape[0], -1).T)
        yield f"{mha}{flax}/bias", per_layer(lay + f"self_attn.{ours}.bias", lambda a: a.reshape(-1))
    # (N, H, W) -> (W, N*H)
    yield f"{mha}out/kernel", per_layer(lay + "self_attn.out_proj.weight", lambda a: a.reshape(-1, a.shape[-1]).T)
    yield f"{mha}out/bias", per_layer(lay + "self_attn.out_proj.bias")


def gemma_rules(expert: int) -> Iterator[tuple[str, Callable[[np.ndarray], Iterator[tuple[str, np.ndarray]]]]]:
    """Rules for one Gemma expert (0 = VLM, 1 = action expert, whose openpi names end in ``_1``)."""
    s = "" if expert == 0 else "_1"
    pre, llm = GEMMA_PREFIX[expert], "PaliGemma/llm/"
    lay = pre + "layers.{}."

    def per_layer(fn: Callable[[np.ndarray], list[tuple[str, np.ndarray]]]):
        return lambda a: ((lay.format(i) + name, t) for i, x in enumerate(a) for name, t in fn(x))

    def q(w):  # (N, D, H) -> (N*H, D)
        return [("self_attn.q_proj.weight", w.transpose(0, 2, 1).reshape(-1, w.shape[1]))]

    def kv(w):  # (2, K, D, H) -> k, v (K*H, D)
        return [(f"self_attn.{n}_proj.weight", w[j].transpose(0, 2, 1).reshape(-1, w.shape[2]))
                for j, n in enumerate("kv")]

    def qkv(w):  # (3, N, D, H) -> q, k, v (N*H, D)
        return [(f"self_attn.{n}_proj.weight", w[j].transpose(0, 2, 1).reshape(-1, w.shape[2]))
                for j, n in enumerate("qkv")]

    if expert == 0:
        yield f"{llm}embedder/input_embedding", lambda a: iter([(pre + "embed_tokens.weight", a)])
    yield f"{llm}final_norm{s}/scale", lambda a: iter([(pre + "norm.weight", a)])
    yield f"{llm}layers/pre_attention_norm{s}/scale", per_layer(lambda x: [("input_layernorm.weight", x)])
    yield f"{llm}layers/pre_ffw_norm{s}/scale", per_layer(lambda x: [("post_attention_layernorm.weight", x)])
    yield f"{llm}layers/attn/q_einsum{s}/w", per_layer(q)
    yield f"{llm}layers/attn/kv_einsum{s}/w", per_layer(kv)
    yield f"{llm}layers/attn/qkv_einsum{s}/w", per_layer(qkv)
    # (N, H, D) -> (D, N*H)
    yield f"{llm}layers/attn/attn_vec_einsum{s}/w", per_layer(
        lambda w: [("self_attn.o_proj.weight", w.reshape(-1, w.shape[-1]).T)])
    yield f"{llm}layers/mlp{s}/gating_einsum", per_layer(
        lambda w: [("mlp.gate_proj.weight", w[0].T), ("mlp.up_proj.weight", w[1].T)])
    yield f"{llm}layers/mlp{s}/linear", per_layer(lambda w: [("mlp.down_proj.weight", w.T)])
    # pi0.5's adaptive norms (expert 1): Dense_0 (C, 3D) of the time condition -> [scale | shift | gate]
    for norm, ours in (("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm")):
        yield f"{llm}layers/{norm}{s}/Dense_0/kernel", per_layer(lambda w, o=ours: [(f"{o}.dense.weight", w.T)])
        yield f"{llm}layers/{norm}{s}/Dense_0/bias", per_layer(lambda b, o=ours: [(f"{o}.dense.bias", b)])
    yield f"{llm}final_norm{s}/Dense_0/kernel", lambda a: iter([(pre + "norm.dense.weight", a.T)])
    yield f"{llm}final_norm{s}/Dense_0/bias", lambda a: iter([(pre + "norm.dense.bias", a)])


def key_rules(cfg: Pi0Config) -> dict[str, Callable[[np.ndarray], Iterator[tuple[str, np.ndarray]]]]:
    """Every openpi key that pi0 knows -> a function producing (torch key, tensor) pairs."""
    rules = dict(siglip_rules())
    rules.update(gemma_rules(0))
    rules.update(gemma_rules(1))
    for head in HEADS:
        rules[f"{head}/kernel"] = lambda a, h=head: iter([(f"{h}.weight", _dense(a))])
        rules[f"{head}/bias"] = lambda a, h=head: iter([(f"{h}.bias", a)])
    return rules


Plan = dict[str, list[tuple[str, tuple[int, ...]]]]


def plan_conversion(flat: Flat, cfg: Pi0Config, expected: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """openpi key -> [(torch key, shape)] from shapes alone (zero-stride arrays are fine), checked strictly.

    An openpi key with no rule, a torch key produced twice, a torch key of ``expected`` left unset,
    or a shape that differs from ``expected`` raises ValueError naming the key.
    """
    rules = key_rules(cfg)
    unknown = sorted(k for k in flat if k not in rules)
    if unknown:
        raise ValueError(f"unknown openpi parameter(s) {unknown[:10]} (total {len(unknown)}): this converter "
                         f"handles pi0 checkpoints; is this another model (pi0-FAST, pi05)?")
    plan: Plan = {}
    seen: dict[str, tuple[int, ...]] = {}
    for key, arr in flat.items():
        plan[key] = []
        for tkey, t in rules[key](np.asarray(arr)):
            if tkey in seen:
                raise ValueError(f"torch key {tkey} produced twice (second time from {key})")
            seen[tkey] = tuple(t.shape)
            plan[key].append((tkey, tuple(t.shape)))
    if expected is not None:
        unused = sorted(set(expected) - set(seen))
        extra = sorted(set(seen) - set(expected))
        if unused or extra:
            raise ValueError(f"checkpoint/model mismatch: model keys never set {unused[:10]}; "
                             f"converted keys the model lacks {extra[:10]}")
        for k, shape in expected.items():
            if seen[k] != tuple(shape):
                raise ValueError(f"shape mismatch for {k}: converted {seen[k]} vs model {tuple(shape)} "
                                 f"(does the config match the checkpoint? drop variant overrides to infer it)")
    return plan


def convert_params(flat: Flat, cfg: Pi0Config, expected: dict[str, tuple[int, ...]] | None = None) -> Flat:
    """openpi flat params -> torch state dict (keys of ``PI0Model``), strictly (see ``plan_conversion``)."""
    plan_conversion({k: np.broadcast_to(np.zeros((), np.float32), np.shape(v)) for k, v in flat.items()},
                    cfg, expected)
    rules = key_rules(cfg)
    return {tkey: np.ascontiguousarray(t) for key, arr in flat.items() for tkey, t in rules[key](np.asarray(arr))}


def cast_for_storage(arr: np.ndarray, dtype: torch.dtype) -> np.ndarray | torch.Tensor:
    """One converted tensor (float32/bf16/other numpy) -> contiguous data in the storage dtype (f32 or bf16).

    bf16 -> bf16 is a byte copy; anything else goes through float32 and torch's round-to-nearest-even cast,
    exactly what loading into a float32 model and saving as bf16 gives.
    """
    if dtype == torch.bfloat16 and arr.dtype.name == "bfloat16":
        return np.ascontiguousarray(arr)
    f32 = np.ascontiguousarray(arr, dtype=np.float32)
    return f32 if dtype == torch.float32 else torch.from_numpy(f32).to(torch.bfloat16)


def _leaf_groups(src: OrbaxParams, keys: list[str], budget: int, itemsize: dict[str, int]) -> list[list[str]]:
    """Consecutive leaves grouped up to ``budget`` bytes as read (a larger leaf is a group of its own)."""
    groups: list[list[str]] = []
    size = budget
    for key in keys:
        n = math.prod(src.shapes[key]) * itemsize[key]
        if size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups


def stream_convert(src: OrbaxParams, plan: Plan, cfg: Pi0Config, out_file: Path,
                   group_bytes: int = 256 << 20) -> None:
    """Restore leaf groups, map, cast and write each tensor into ``out_file`` (model.safetensors) in turn."""
    import ml_dtypes


    specs = {f"model.{t}": (param_storage_dtype(t, cfg.dtype), shape) for outs in plan.values() for t, shape in outs}
    # Leaves whose every output is stored in bf16 are read as bf16 (cast by tensorstore while reading).
    to_bf16 = {k: ml_dtypes.bfloat16 for k, outs in plan.items() if src.dtypes[k].name != "bfloat16"
               and outs and all(specs[f"model.{t}"][0] == torch.bfloat16 for t, _ in outs)}
    itemsize = {k: 2 if k in to_bf16 else src.dtypes[k].itemsize for k in plan}
    rules = key_rules(cfg)
    with SafetensorsWriter(out_file, specs) as writer:
        for group in _leaf_groups(src, list(plan), group_bytes, itemsize):
            leaves = src.read(group, {k: to_bf16[k] for k in group if k in to_bf16})
            for key in group:
                for tkey, t in rules[key](leaves.pop(key)):
                    writer.write(f"model.{tkey}", cast_for_storage(t, specs[f"model.{tkey}"][0]))
                    del t


# ---------------------------------------------------------------------------------------------- driver
def find_norm_stats(params_dir: Path) -> Path | None:
    """openpi keeps norm stats in <ckpt>/assets/<asset_id>/norm_stats.json next to <ckpt>/params."""
    hits = sorted(glob.glob(str(params_dir.resolve().parent / "assets" / "**" / "norm_stats.json"), recursive=True))
    if len(hits) > 1:
        log.warning("several norm_stats.json found, using %s (pass --norm_stats to choose): %s", hits[0], hits)
    return Path(hits[0]) if hits else None


# Asset ids whose openpi data config predicts delta actions for the leading dims (AbsoluteActions on output).
DELTA_ACTION_DIMS_BY_ASSET = {"physical-intelligence/libero": 6}
DELTA_ACTION_HELP = (
    "--delta_action_dims N says that the model predicts the first N action dims as deltas relative to the current "
    "state and the policy adds the state back (openpi's AbsoluteActions output transform); 0 means absolute actions. "
    "openpi's configs: pi0_libero (LeRobotLiberoDataConfig(extra_delta_transform=True), mask make_bool_mask(6, -1)) "
    "-> 6; pi0_droid / pi0_fast_droid (DroidInputs/DroidOutputs, no delta transform) -> 0 (absolute); pi0_aloha "
    "(use_delta_joint_actions=True, mask make_bool_mask(6, -1, 6, -1): both arms' 6 joints delta, both grippers "
    "absolute) is not a leading block, so it cannot be expressed by N. A wrong value silently ruins every rollout "
    "(on LIBERO, N=0 instead of 6 drops success to near zero).")


def resolve_delta_action_dims(ns_path: Path, delta_action_dims: int | None) -> int:
    """The delta-action count: given explicitly, or known from the norm stats' asset id; otherwise refuse."""
    parts = ns_path.resolve().parent.parts
    # openpi: <ckpt>/assets/<asset_id>/norm_stats.json, where asset_id may contain "/" (physical-intelligence/libero)
    asset_id = "/".join(parts[len(parts) - parts[::-1].index("assets"):] if "assets" in parts else parts[-2:])
    if delta_action_dims is not None:
        if delta_action_dims < 0:
            raise UserError(f"--delta_action_dims must be >= 0, got {delta_action_dims}. {DELTA_ACTION_HELP}")
        return delta_action_dims
    if asset_id in DELTA_ACTION_DIMS_BY_ASSET:
        n = DELTA_ACTION_DIMS_BY_ASSET[asset_id]
        log.info("asset %s: the policy predicts deltas on the first %d action dims", asset_id, n)
        return n
    raise UserError(f"norm stats {ns_path} belong to asset id {asset_id!r}, for which this converter does not know "
                     f"whether actions are deltas; pass --delta_action_dims N. {DELTA_ACTION_HELP}")


def convert_checkpoint(checkpoint_dir: str | Path, output_path: str | Path, norm_stats: str | Path | None = None,
                       tokenizer: str | Path | None = None, dtype: str = "float32",
                       delta_action_dims: int | None = None, openpi_config: str | None = None,
                       **config_overrides: Any) -> Path:
    """Convert ``<ckpt>/params`` into a ``PI0Policy`` directory, streaming; every input is checked first.

    ``openpi_config`` (a name in ``pi0.conversion.openpi_configs.OPENPI_CONFIGS``) supplies the horizon, token budget,
    normalization and delta dims of that openpi TrainConfig; explicit arguments win over it.
    """

    params_dir = Path(checkpoint_dir)
    if not params_dir.exists():
        raise MissingPathError(f"--checkpoint_dir {params_dir} does not exist (expected openpi's <ckpt>/params)")
    output_path = Path(output_path)
    if output_path.exists() and any(output_path.iterdir()) and not (output_path / "config.json").is_file():
        raise PathExistsError(f"--output_path {output_path} exists and is not a policy directory; choose a new path")
    ns_path = Path(norm_stats) if norm_stats else find_norm_stats(params_dir)
    if ns_path is None:
        raise MissingPathError(f"no norm_stats.json under {params_dir.resolve().parent}/assets/*/; "
                               f"pass --norm_stats PATH")
    stats = load_norm_stats(ns_path)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise MissingPathError(f"--tokenizer {tokenizer} does not exist")
    src = OrbaxParams(params_dir)  # metadata only
    model_type = "pi05" if is_pi05_tree(src.shapes) else "pi0"
    if model_type == "pi05" and openpi_config is None:
        raise UserError(f"{params_dir} holds a pi0.5 tree, which does not say its horizon, token budget, delta dims "
                        f"or prompt format (pi05_libero: no delta actions, no state in the prompt, although its norm "
                        f"stats carry the LIBERO asset id); pass --openpi_config NAME, one of "
                        f"{', '.join(names_for('pi05'))}")
    normalization = "zscore"
    discrete_state_input = False
    if openpi_config is not None:
        preset = get_openpi_config(openpi_config, model_type)
        discrete_state_input = preset.prompt_format == "pi05_state"
        config_overrides.setdefault("action_horizon", preset.action_horizon)
        config_overrides.setdefault("max_token_len", preset.max_token_len)
        normalization = preset.normalization
        if delta_action_dims is None:
            delta_action_dims = preset.delta_action_dims
    delta_action_dims = resolve_delta_action_dims(ns_path, delta_action_dims)
    cfg = infer_config(src.shape_view(), dtype=dtype, **config_overrides)
    log.info("inferred config: %s", cfg)
    with torch.device("meta"):
        model = PI0Model(cfg)
    plan = plan_conversion(src.shape_view(), cfg, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    # Write into a sibling temp dir and rename at the end: a failed conversion leaves no partial output.
    with atomic_directory(output_path) as tmp_out:
        if tokenizer is None:
            log.warning("no --tokenizer given: writing a small offline stand-in tokenizer; pass PaliGemma's "
                        "sentencepiece model for real checkpoints")
            tokenizer = build_tokenizer_model(tmp_out / "tokenizer.model")
        else:
            shutil.copyfile(tokenizer, tmp_out / "tokenizer.model")
        pol_cfg = PolicyConfig(model=cfg, delta_action_dims=delta_action_dims, normalization=normalization,
                               discrete_state_input=discrete_state_input)
        PI0Policy(pol_cfg, stats, PaligemmaTokenizer(tmp_out / "tokenizer.model", cfg.max_token_len), model)  # checks
        stream_convert(src, plan, cfg, tmp_out / "model.safetensors")
        (tmp_out / "config.json").write_text(json.dumps(pol_cfg.to_dict(), indent=2))
        save_norm_stats(stats, tmp_out / "norm_stats.json")
    return output_path
