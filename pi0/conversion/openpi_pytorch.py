"""PyTorch pi0 / pi0.5 checkpoints of other tools -> our ``PI0Policy``, and our policy -> openpi's PyTorch format.

Layouts read (detected from the files and the key prefixes, never from the path):
- ``openpi-pytorch``: openpi's ``examples/convert_jax_model_to_pytorch.py`` output or a ``scripts/train_pytorch.py``
  save: ``model.safetensors`` with ``paligemma_with_expert.*`` keys, an optional ``config.json`` (``action_dim``,
  ``action_horizon``, the two variant names, ``precision``), norm stats in ``assets/<asset_id>/norm_stats.json``.
- ``rlinf``: the same weights (RLinf subclasses openpi's ``PI0Pytorch``; FSDP prefixes ``_fsdp_wrapped_module.``,
  ``_orig_mod.``, ``module.`` are dropped), norm stats in ``<org>/<repo>/norm_stats.json``.
- ``lerobot``: LeRobot's ``pi0`` / ``pi05``: ``config.json`` with ``"type"``, the openpi key names under ``model.``,
  norm stats in ``policy_preprocessor*`` / ``policy_postprocessor*`` safetensors (flat keys ``observation.state.mean``,
  ``action.q01``); ``lerobot-legacy`` (releases before Oct 2025): ``model.paligemma_with_expert.paligemma.
  language_model.model.*`` and the norm stats as buffers ``normalize_inputs.buffer_observation_state.mean`` etc.

Every layout is first renamed to openpi's key names (``canonical_key``), then mapped to ours by one plain key map
(``openpi_to_ours``): our model already keeps openpi-PyTorch's tensor layouts (q/k/v and gate/up split, Linear
weights ``[out, in]``), so only names move; the tied embedding, stored once as ``paligemma.lm_head.weight``, becomes
our ``embed_tokens``. The architecture comes from the tensor shapes (``infer_config``); head counts, which shapes
cannot split from head_dim, come from the variant names in config.json or from the unique known variant of those sizes.
Tensors are read one at a time (positioned reads of the safetensors file) and cast individually.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pi0.conversion.openpi_configs import get_openpi_config, names_for
from pi0.errors import MissingPathError, UserError
from pi0.models.config import GEMMA_VARIANTS, SIGLIP_VARIANTS, GemmaConfig, Pi0Config, SiglipConfig
from pi0.models.pi0 import PI0Model, param_storage_dtype
from pi0.policies.normalize import NormStats, Stats, load_norm_stats, save_norm_stats
from pi0.utils import checkpoint_io
from pi0.utils.checkpoint_io import TensorEntry

log = logging.getLogger(__name__)

Shapes = dict[str, tuple[int, ...]]

FOREIGN_LAYOUTS = ("openpi-pytorch", "rlinf", "lerobot", "lerobot-legacy")
# --from of the converter -> the layouts it accepts (openpi-PyTorch and RLinf hold the same weights)
FROM_CHOICES = {"openpi-pytorch": ("openpi-pytorch", "rlinf"), "rlinf": ("openpi-pytorch", "rlinf"),
                "lerobot": ("lerobot", "lerobot-legacy")}

# openpi-PyTorch names (PI0Pytorch's state dict)
P = "paligemma_with_expert."
O_PG = P + "paligemma."
O_VLM = O_PG + "model.language_model."
O_VIS = O_PG + "model.vision_tower."
O_MMP = O_PG + "model.multi_modal_projector."
O_LM_HEAD = O_PG + "lm_head.weight"  # the tied embedding, stored once (save_model drops embed_tokens)
O_EMBED = O_VLM + "embed_tokens.weight"
O_EXPERT = P + "gemma_expert.model."
O_EXPERT_HEAD = P + "gemma_expert.lm_head.weight"  # in every openpi file, never converted and never used
# our names (PI0Model's state dict)
U_PG = P + "paligemma."
U_VLM = U_PG + "language_model.model."
U_EMBED = U_VLM + "embed_tokens.weight"

HEADS = ("state_proj.", "action_in_proj.", "action_out_proj.", "action_time_mlp_in.", "action_time_mlp_out.",
         "time_mlp_in.", "time_mlp_out.")
FSDP_PARTS = ("_fsdp_wrapped_module.", "_orig_mod.", "module.")
LEGACY_BUFFERS = ("normalize_inputs.", "normalize_targets.", "unnormalize_outputs.")
# as in LeRobot's pi0 _transform_state_dict_keys (PR #1415): legacy name -> current (= openpi) name, after "model."
LEGACY_RENAMES = ((O_PG + "language_model.lm_head.", O_PG + "lm_head."),
                  (O_PG + "language_model.model.", O_VLM),
                  (O_PG + "vision_tower.", O_VIS),
                  (O_PG + "multi_modal_projector.", O_MMP))


# ---------------------------------------------------------------------------------------------- key map (pure)
def canonical_key(key: str, layout: str) -> str:
    """A key of ``layout`` -> openpi-PyTorch's name for the same tensor."""
    if layout in ("openpi-pytorch", "rlinf"):
        for part in FSDP_PARTS:
            key = key.replace(part, "")
        return key
    if layout in ("lerobot", "lerobot-legacy"):
        if not key.startswith("model."):
            raise UserError(f"unexpected key {key!r} in a LeRobot pi0 model.safetensors (its weights are under "
                            f"'model.')")
        key = key.removeprefix("model.")
        if layout == "lerobot-legacy":
            for old, new in LEGACY_RENAMES:
                if key.startswith(old):
                    return new + key.removeprefix(old)
        return key
    raise ValueError(f"unknown layout {layout!r}")


def openpi_to_ours(key: str) -> str | None:
    """openpi-PyTorch key -> our PI0Model key (None: a tensor we do not use, the action expert's ``lm_head``).

    Raises UserError for a key with no counterpart.
    """
    # as in openpi's convert_jax_model_to_pytorch.py: the PaliGemma tensors sit under paligemma.model.* (HF >= 4.52
    # PaliGemmaForConditionalGeneration), ours under the older paligemma.{vision_tower, language_model.model}.*
    if key == O_EXPERT_HEAD:
        return None
    if key == O_LM_HEAD:
        return U_EMBED
    for o, u in ((O_VLM, U_VLM), (O_VIS, U_PG + "vision_tower."), (O_MMP, U_PG + "multi_modal_projector.")):
        if key.startswith(o):
            return u + key.removeprefix(o)
    if key.startswith(O_EXPERT) or key.startswith(HEADS):
        return key
    raise UserError(f"unexpected key {key!r}: no pi0 / pi0.5 tensor has this name in openpi's PyTorch format")


def ours_to_openpi(key: str) -> str:
    """Our PI0Model key -> openpi-PyTorch key (``embed_tokens`` -> the tied ``lm_head``, as openpi's files store it)."""
    if key == U_EMBED:
        return O_LM_HEAD
    for u, o in ((U_VLM, O_VLM), (U_PG + "vision_tower.", O_VIS), (U_PG + "multi_modal_projector.", O_MMP)):
        if key.startswith(u):
            return o + key.removeprefix(u)
    if key.startswith(P + "gemma_expert.model.") or key.startswith(HEADS):
        return key
    raise UserError(f"{key!r} has no place in openpi's PyTorch format (an RL-only module? save it in our format)")


def plan_load(shapes: Shapes, expected: Shapes) -> dict[str, str]:
    """{our key: openpi key} from canonical (openpi) names and shapes, strictly.

    A key with no counterpart, an expected key nothing provides, or a shape that differs raises a one-line UserError
    naming the key. ``embed_tokens`` and ``lm_head`` may both be present (LeRobot saves after cloning one into the
    other): the embedding wins and ``lm_head`` is unused, as in openpi's model.
    """
    plan: dict[str, str] = {}
    for key in sorted(shapes):
        if key == O_LM_HEAD and O_EMBED in shapes:
            continue
        ours = U_EMBED if key == O_EMBED else openpi_to_ours(key)
        if ours is None:
            continue
        if ours not in expected:
            raise UserError(f"unexpected key {key!r} (ours: {ours}): the model inferred from the tensors has no such "
                            f"tensor (a pi0 tree with pi0.5 keys, or another model?)")
        if tuple(shapes[key]) != tuple(expected[ours]):
            raise UserError(f"shape mismatch for {key!r}: file {tuple(shapes[key])} vs model {tuple(expected[ours])}")
        plan[ours] = key
    missing = [k for k in expected if k not in plan]
    if missing:
        names = [O_LM_HEAD if k == U_EMBED else ours_to_openpi(k) for k in missing]
        raise UserError(f"missing key {names[0]!r} ({len(missing)} missing in all): the checkpoint lacks tensors "
                        f"the model needs")
    return plan


# ---------------------------------------------------------------------------------------------- architecture
def _depth(shapes: Shapes, prefix: str) -> int:
    """Number of layers ``prefix``N.* present."""
    idx = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if not idx:
        raise UserError(f"missing key {prefix + '0.*'!r}: no layers found")
    return max(idx) + 1


def _shape(shapes: Shapes, key: str) -> tuple[int, ...]:
    """Shape of ``key`` or a one-line error naming it."""
    if key not in shapes:
        raise UserError(f"missing key {key!r}: needed to tell the model's sizes")
    return tuple(shapes[key])


def gemma_config_of(shapes: Shapes, prefix: str, variant: str | GemmaConfig | None, what: str) -> GemmaConfig:
    """A Gemma's sizes from its tensors under ``prefix``; heads from ``variant`` (a name or a GemmaConfig, checked
    against the tensors) or the unique known variant of those sizes."""
    lay = prefix + "layers.0."
    q, k = _shape(shapes, lay + "self_attn.q_proj.weight"), _shape(shapes, lay + "self_attn.k_proj.weight")
    width, depth, mlp = q[1], _depth(shapes, prefix + "layers."), _shape(shapes, lay + "mlp.gate_proj.weight")[0]
    seen = (width, depth, mlp, q[0], k[0])  # q rows = heads * head_dim, k rows = kv_heads * head_dim

    def sizes(g: GemmaConfig) -> tuple:
        return g.width, g.depth, g.mlp_dim, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim

    if isinstance(variant, str) and variant != "custom":
        variant = variant.removesuffix("_lora")  # as in openpi gemma.py get_config: *_lora = the same sizes + LoRA
        if variant not in GEMMA_VARIANTS:
            raise UserError(f"{what} variant {variant!r} is not one of {sorted(GEMMA_VARIANTS)}")
        variant = GemmaConfig.from_variant(variant)
    if isinstance(variant, GemmaConfig):
        if sizes(variant) != seen:
            raise UserError(f"{what} variant {variant.variant!r} does not match the tensors under {prefix}: width, "
                            f"depth, mlp, q rows, kv rows {seen} vs {sizes(variant)}")
        return variant
    hits = [name for name in GEMMA_VARIANTS if sizes(GemmaConfig.from_variant(name)) == seen]
    if len(hits) != 1:
        raise UserError(f"cannot tell {what}'s attention heads from its tensors (width, depth, mlp, q rows, kv rows "
                        f"{seen}); name its variant (paligemma_variant / action_expert_variant)")
    return GemmaConfig.from_variant(hits[0])


def siglip_config_of(shapes: Shapes) -> SiglipConfig:
    """SigLIP sizes from the vision tower's tensors; heads from the big_vision variant of that width/depth/mlp."""
    vm = O_VIS + "vision_model."
    w, _, p, _ = _shape(shapes, vm + "embeddings.patch_embedding.weight")  # (W, 3, p, p)
    n_pos = _shape(shapes, vm + "embeddings.position_embedding.weight")[0]
    depth = _depth(shapes, vm + "encoder.layers.")
    mlp = _shape(shapes, vm + "encoder.layers.0.mlp.fc1.weight")[0]
    hits = [name for name, v in SIGLIP_VARIANTS.items() if v[:3] == (w, depth, mlp)]
    if len(hits) != 1 or math.isqrt(n_pos) ** 2 != n_pos:
        raise UserError(f"the vision tower's tensors (width {w}, depth {depth}, mlp {mlp}, {n_pos} positions) match no "
                        f"single SigLIP variant of {sorted(SIGLIP_VARIANTS)}")
    return SiglipConfig.from_variant(f"{hits[0]}/{p}", image_size=math.isqrt(n_pos) * p)


def is_pi05(shapes: Shapes) -> bool:
    """pi0.5 from its tensors: ``time_mlp_in`` and adaRMS ``.dense`` norms instead of ``state_proj``."""
    return "time_mlp_in.weight" in shapes


def infer_config(shapes: Shapes, paligemma_variant: str | None = None, action_expert_variant: str | None = None,
                 **fields: Any) -> Pi0Config:
    """Pi0Config from openpi-PyTorch shapes (canonical names); ``fields`` set the rest (horizon, token budget, dtype;
    ``paligemma`` / ``action_expert`` GemmaConfigs for sizes no variant name has, checked against the tensors)."""
    vocab = _shape(shapes, O_EMBED if O_EMBED in shapes else O_LM_HEAD)[0]
    paligemma = gemma_config_of(shapes, O_VLM, fields.pop("paligemma", None) or paligemma_variant, "the VLM")
    expert = gemma_config_of(shapes, O_EXPERT, fields.pop("action_expert", None) or action_expert_variant,
                             "the action expert")
    return Pi0Config(paligemma=paligemma, action_expert=expert,
                     vision=siglip_config_of(shapes), vocab_size=vocab,
                     action_dim=_shape(shapes, "action_in_proj.weight")[1], pi05=is_pi05(shapes), **fields)


# ---------------------------------------------------------------------------------------------- detection
@dataclass
class Checkpoint:
    """A directory in a foreign layout: its weights (canonical names), config and where its parts were found."""

    directory: Path
    layout: str  # one of FOREIGN_LAYOUTS
    tensors: dict[str, tuple[Path, TensorEntry]]  # canonical (openpi) key -> (file, header entry)
    config: dict[str, Any] = field(default_factory=dict)  # config.json (openpi's or LeRobot's), {} when absent
    buffers: dict[str, tuple[Path, TensorEntry]] = field(default_factory=dict)  # lerobot-legacy normalization

    @property
    def shapes(self) -> Shapes:
        """Canonical key -> shape."""
        return {k: e.shape for k, (_, e) in self.tensors.items()}

    @property
    def model_type(self) -> str:
        """'pi05' or 'pi0', from the tensors."""
        return "pi05" if is_pi05(self.shapes) else "pi0"


EXPECTED = ("our policy directory (config.json with 'model', model.safetensors, norm_stats.json, tokenizer.model), "
            "openpi-PyTorch / RLinf (model.safetensors with 'paligemma_with_expert.*' keys) or LeRobot pi0/pi05 "
            "(config.json with \"type\": \"pi0\"|\"pi05\" and model.safetensors)")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object or a one-line UserError."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, expected a JSON object")
    return data


def _found(directory: Path) -> str:
    """What is in ``directory``, for error messages (a few names)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    return ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"


def is_our_policy_dir(directory: str | Path) -> bool:
    """True for a directory in our own format (config.json holds a PolicyConfig: a 'model' dict or 'model_type')."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # ours or nobody's: the existing loader reports the bad JSON
    return isinstance(data, dict) and (isinstance(data.get("model"), dict) or "model_type" in data)


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, else every *.safetensors that is not a LeRobot processor file (sharded saves)."""
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("policy_"))


def detect(directory: str | Path) -> Checkpoint:
    """Read a foreign checkpoint's layout from its files and key prefixes (headers only); UserError when unreadable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingPathError(f"checkpoint directory {directory} does not exist")
    if is_our_policy_dir(directory):
        raise UserError(f"{directory} is already our policy directory: load it with load_policy, nothing to convert")
    config = _read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    files = _weight_files(directory)
    lerobot_type = config.get("type")
    if not files:
        raise UserError(f"{directory}: found {_found(directory)}; expected {EXPECTED}")
    raw: dict[str, tuple[Path, TensorEntry]] = {}
    for f in files:
        for k, e in checkpoint_io.read_safetensors_header(f).items():
            if k in raw:
                raise UserError(f"key {k!r} is stored twice ({raw[k][0].name} and {f.name})")
            raw[k] = (f, e)
    if lerobot_type is not None:
        if lerobot_type not in ("pi0", "pi05"):
            raise UserError(f"{directory}: found a LeRobot '{lerobot_type}' policy; expected LeRobot pi0 or pi05")
        legacy = any(k.startswith("model." + O_PG + "language_model.") for k in raw)
        layout = "lerobot-legacy" if legacy else "lerobot"
    elif any(k.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", "").replace("module.", "")
             .startswith(P) for k in raw):
        layout = "rlinf" if _rlinf_stats(directory) and not (directory / "assets").is_dir() else "openpi-pytorch"
    else:
        prefixes = sorted({k.split(".")[0] + "." for k in raw})[:5]
        raise UserError(f"{directory}: found {', '.join(f.name for f in files)} with keys under {prefixes}"
                        f"{' and no config.json' if not config else ''}; expected {EXPECTED}")
    tensors: dict[str, tuple[Path, TensorEntry]] = {}
    buffers: dict[str, tuple[Path, TensorEntry]] = {}
    for k, v in raw.items():
        if layout == "lerobot-legacy" and k.startswith(LEGACY_BUFFERS):
            buffers[k] = v
            continue
        ck = canonical_key(k, layout)
        if ck in tensors:
            raise UserError(f"key {ck!r} is stored twice (as {k!r} too)")
        tensors[ck] = v
    return Checkpoint(directory, layout, tensors, config, buffers)


# ---------------------------------------------------------------------------------------------- norm stats
NORM_STATS_ORDER = ("--norm_stats PATH", "<dir>/norm_stats.json", "<dir>/assets/<asset_id>/norm_stats.json (openpi)",
                    "<dir>/<org>/<repo>/norm_stats.json (RLinf)",
                    "<dir>/policy_preprocessor*.safetensors + policy_postprocessor*.safetensors (LeRobot)",
                    "normalize_inputs / unnormalize_outputs buffers in model.safetensors (LeRobot before Oct 2025)")


def _rlinf_stats(directory: Path) -> list[str]:
    """``<dir>/<org>/<repo>/norm_stats.json`` files (RLinf's layout, no ``assets/`` level)."""
    return sorted(p for p in glob.glob(str(directory / "*" / "*" / "norm_stats.json"))
                  if Path(p).relative_to(directory).parts[0] != "assets")


def _one(hits: list[str], where: str) -> Path | None:
    """The single hit, None for none, a UserError for several."""
    if len(hits) > 1:
        raise UserError(f"several norm stats under {where}: {hits}; choose one with --norm_stats PATH")
    return Path(hits[0]) if hits else None


@dataclass
class FoundStats:
    """Norm stats and where they came from."""

    stats: NormStats
    source: str  # path or description, for messages
    asset_path: Path | None = None  # a norm_stats.json whose directories name the asset id (openpi / RLinf)
    lerobot_modes: tuple[str, str] | None = None  # (state, action) modes recorded by LeRobot's processor config


def _lerobot_stats(files: list[Path], prefix: str) -> dict[str, np.ndarray]:
    """Flat ``<feature>.<stat>`` arrays (D,) of LeRobot's (un)normalizer processor files, keys under ``prefix``."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k.startswith(prefix):
                out[k.removeprefix(prefix)] = np.asarray(v, dtype=np.float64).reshape(-1)
    return out


def _stats_from_flat(flat: dict[str, np.ndarray], feature: str, source: str) -> Stats:
    """Stats of one feature from flat {'mean': .., 'std': .., 'q01': ..}; mean and std are required."""
    for need in ("mean", "std"):
        if need not in flat:
            raise UserError(f"{source} lacks {feature}.{need} (found {sorted(flat) or 'nothing'} for {feature})")
    return Stats(flat["mean"], flat["std"], flat.get("q01"), flat.get("q99"))


def _lerobot_processor_modes(directory: Path) -> tuple[str, str] | None:
    """(STATE, ACTION) normalization modes from LeRobot's policy_preprocessor.json normalizer step, if present."""
    path = directory / "policy_preprocessor.json"
    if not path.is_file():
        return None
    for step in _read_json(path).get("steps", []):
        norm_map = (step.get("config") or {}).get("norm_map")
        if step.get("registry_name") == "normalizer_processor" and norm_map:
            return norm_map.get("STATE", "IDENTITY"), norm_map.get("ACTION", "IDENTITY")
    return None


def find_norm_stats(ckpt: Checkpoint, norm_stats: str | Path | None = None) -> FoundStats:
    """Norm stats searched in ``NORM_STATS_ORDER``; a directory without any gets a one-line error saying where they
    come from."""
    d = ckpt.directory
    if norm_stats is not None:
        path = Path(norm_stats)
        if not path.is_file():
            raise MissingPathError(f"--norm_stats {path} does not exist")
        return FoundStats(load_norm_stats(path), str(path), path)
    if (d / "norm_stats.json").is_file():
        return FoundStats(load_norm_stats(d / "norm_stats.json"), str(d / "norm_stats.json"), d / "norm_stats.json")
    for hits, where in ((sorted(glob.glob(str(d / "assets" / "**" / "norm_stats.json"), recursive=True)),
                         f"{d}/assets"), (_rlinf_stats(d), f"{d}/<org>/<repo>")):
        path = _one(hits, where)
        if path is not None:
            return FoundStats(load_norm_stats(path), str(path), path)
    pre = sorted(d.glob("policy_preprocessor*.safetensors"))
    post = sorted(d.glob("policy_postprocessor*.safetensors"))
    if pre or post:
        src = ", ".join(p.name for p in pre + post)
        state = _lerobot_stats(pre, "observation.state.")
        action = _lerobot_stats(post, "action.") or _lerobot_stats(pre, "action.")
        return FoundStats({"state": _stats_from_flat(state, "observation.state", src),
                           "actions": _stats_from_flat(action, "action", src)}, src,
                          lerobot_modes=_lerobot_processor_modes(d))
    if ckpt.buffers:
        def buf(name: str) -> dict[str, np.ndarray]:
            return {k.removeprefix(name): checkpoint_io.read_tensor(f, e, k).double().numpy().reshape(-1)
                    for k, (f, e) in ckpt.buffers.items() if k.startswith(name)}

        src = "model.safetensors normalization buffers"
        stats = {"state": _stats_from_flat(buf("normalize_inputs.buffer_observation_state."), "observation.state", src),
                 "actions": _stats_from_flat(buf("unnormalize_outputs.buffer_action."), "action", src)}
        if not all(np.isfinite(v).all() for s in stats.values() for v in (s.mean, s.std)):
            raise UserError(f"{d}: the normalization buffers in model.safetensors are not finite (a LeRobot policy "
                            f"saved without dataset stats); pass --norm_stats PATH")
        return FoundStats(stats, src)
    raise UserError(f"no norm stats in {d} (searched, in order: {'; '.join(NORM_STATS_ORDER)}); openpi's converter "
                    f"copies them only from <ckpt>/../assets: copy openpi's assets/<asset_id>/norm_stats.json into "
                    f"the directory or pass --norm_stats PATH")


# ---------------------------------------------------------------------------------------------- policy settings
LEROBOT_MODES = {"MEAN_STD": "zscore", "QUANTILES": "quantile"}


@dataclass
class Settings:
    """What a PolicyConfig needs beyond the tensors, and where each value came from."""

    action_horizon: int
    max_token_len: int
    normalization: str
    delta_action_dims: int
    discrete_state_input: bool
    extra: dict[str, Any] = field(default_factory=dict)  # other PolicyConfig fields (n_action_steps, num_steps)


def _lerobot_settings(ckpt: Checkpoint, found: FoundStats) -> Settings:
    """LeRobot's config.json (chunk_size, tokenizer_max_length, normalization_mapping, ...) -> Settings."""
    c, kind = ckpt.config, ckpt.config["type"]
    if c.get("use_relative_actions"):
        raise UserError(f"{ckpt.directory}/config.json: use_relative_actions=true (LeRobot's relative actions) is not "
                        f"supported here")
    modes = found.lerobot_modes or (c.get("normalization_mapping", {}).get("STATE", "MEAN_STD"),
                                    c.get("normalization_mapping", {}).get("ACTION", "MEAN_STD"))
    if modes[0] != modes[1] or modes[0] not in LEROBOT_MODES:
        raise UserError(f"{ckpt.directory}: LeRobot normalization STATE={modes[0]}, ACTION={modes[1]}; supported: the "
                        f"same mode for both, one of {sorted(LEROBOT_MODES)}")
    horizon = int(c.get("chunk_size", 50))
    extra = {"num_steps": int(c.get("num_inference_steps", 10)),
             "n_action_steps": min(int(c.get("n_action_steps", horizon)), horizon)}
    # as in LeRobot's pi05 processor: the normalized state is discretized into the prompt (256 bins);
    # its pi0 appends "\n" to the task as openpi's tokenizer does. No delta actions in either.
    # LeRobot's normalizer computes (x - mean) / (std + 1e-8) and 2 (x - q01) / (q99 - q01) - 1 (eps only for equal
    # quantiles); ours is openpi's (eps 1e-6 in both): a relative difference of about 1e-6 / std.
    return Settings(horizon, int(c.get("tokenizer_max_length", 200 if kind == "pi05" else 48)), LEROBOT_MODES[modes[0]],
                    0, kind == "pi05", extra)


def resolve_settings(ckpt: Checkpoint, found: FoundStats, openpi_config: str | None = None,
                     delta_action_dims: int | None = None, given: frozenset[str] = frozenset()) -> Settings:
    """Horizon, token budget, normalization, delta dims and prompt format: from ``openpi_config`` (a preset), else
    LeRobot's config.json, else openpi's defaults for the tensors' model type (pi0: z-score, delta dims from the
    asset id; pi0.5: quantile, 200 tokens). A pi0.5 in openpi's format needs the preset, or delta dims and the prompt
    format given explicitly (``given``: the option names the caller sets), as its files cannot say them."""
    from pi0.conversion.pi0 import resolve_delta_action_dims

    model_type = ckpt.model_type
    if openpi_config is not None:
        p = get_openpi_config(openpi_config, model_type)
        horizon = p.action_horizon
        stated = ckpt.config.get("action_horizon")
        if stated is not None and int(stated) != horizon and "action_horizon" not in given:
            log.warning("%s: config.json says action_horizon %s, --openpi_config %s says %d; using %d (as openpi "
                        "serving does: the train config decides)", ckpt.directory, stated, openpi_config, horizon,
                        horizon)
        delta = p.delta_action_dims if delta_action_dims is None else delta_action_dims
        return Settings(horizon, p.max_token_len, p.normalization, delta, p.prompt_format == "pi05_state")
    if ckpt.layout.startswith("lerobot"):
        s = _lerobot_settings(ckpt, found)
        if delta_action_dims is not None:
            s.delta_action_dims = delta_action_dims
        return s
    horizon = int(ckpt.config.get("action_horizon", 50))
    if model_type == "pi05":
        if delta_action_dims is not None and "discrete_state_input" in given:
            # as in openpi pi0_config.py: pi0.5 defaults to max_token_len 200; training/config.py: quantile norm
            return Settings(horizon, 200, "quantile", delta_action_dims, False)
        raise UserError(f"{ckpt.directory} holds a pi0.5 (time_mlp_in / adaRMS tensors), whose files do not say its "
                        f"normalization, delta dims or prompt format; pass --openpi_config NAME, one of "
                        f"{', '.join(names_for('pi05'))} (or delta_action_dims and discrete_state_input)")
    if found.asset_path is None and delta_action_dims is None:
        raise UserError(f"norm stats from {found.source} carry no asset id; pass --delta_action_dims N (0 = absolute "
                        f"actions) or --openpi_config NAME")
    delta = (delta_action_dims if found.asset_path is None
             else resolve_delta_action_dims(found.asset_path, delta_action_dims))
    return Settings(horizon, 48, "zscore", delta, False)


# ---------------------------------------------------------------------------------------------- tokenizer
def find_tokenizer(directory: Path, tokenizer: str | Path | None) -> Path:
    """``tokenizer`` or <dir>/tokenizer.model; a one-line error when neither exists."""
    if tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise MissingPathError(f"--tokenizer {tokenizer} does not exist")
        return Path(tokenizer)
    if (directory / "tokenizer.model").is_file():
        return directory / "tokenizer.model"
    raise UserError(f"no tokenizer.model in {directory}: openpi-PyTorch / RLinf / LeRobot checkpoints do not ship "
                    f"PaliGemma's sentencepiece model; pass --tokenizer PATH or copy it to {directory}/tokenizer.model")


# ---------------------------------------------------------------------------------------------- the whole plan
@dataclass
class ForeignPlan:
    """Everything needed to build or write the policy, decided from headers and small files only."""

    ckpt: Checkpoint
    policy_config: Any  # PolicyConfig
    stats: NormStats
    sources: dict[str, tuple[Path, TensorEntry]]  # our key -> (file, entry)


def plan_foreign(directory: str | Path, norm_stats: str | Path | None = None, openpi_config: str | None = None,
                 delta_action_dims: int | None = None, layouts: tuple[str, ...] = FOREIGN_LAYOUTS,
                 **overrides: Any) -> ForeignPlan:
    """Detect, infer the architecture, find the stats and settings, and check every key and shape (no tensor read).

    ``overrides``: PolicyConfig fields (n_action_steps, num_steps, ...), model fields (dtype, action_horizon,
    max_token_len, attn_implementation, ...) or ``paligemma_variant`` / ``action_expert_variant`` (the heads, for a
    file without config.json whose sizes match no known variant) that win over what was inferred.
    """
    from pi0.policies.pi0 import PolicyConfig

    variants = {k: overrides.pop(k, None) for k in ("paligemma_variant", "action_expert_variant")}
    ckpt = detect(directory)
    if ckpt.layout not in layouts:
        raise UserError(f"{ckpt.directory} is in {ckpt.layout} layout, not {' / '.join(layouts)}")
    found = find_norm_stats(ckpt, norm_stats)
    s = resolve_settings(ckpt, found, openpi_config, delta_action_dims, frozenset(overrides))
    model_fields = {f.name for f in dataclasses.fields(Pi0Config)}
    policy_fields = {f.name for f in dataclasses.fields(PolicyConfig)} - {"model"}
    bad = sorted(set(overrides) - model_fields - policy_fields)
    if bad:
        raise UserError(f"unknown option(s) {bad}; valid: PolicyConfig fields {sorted(policy_fields)} or model fields "
                        f"{sorted(model_fields)}")
    model_kw = {"action_horizon": s.action_horizon, "max_token_len": s.max_token_len,
                **{k: v for k, v in overrides.items() if k in model_fields}}
    c = ckpt.config
    variants = {k: v if v is not None else c.get(k) for k, v in variants.items()}  # given > config.json
    cfg = infer_config(ckpt.shapes, **variants, **model_kw)
    pol_kw = {"normalization": s.normalization, "delta_action_dims": s.delta_action_dims,
              "discrete_state_input": s.discrete_state_input, **s.extra,
              **{k: v for k, v in overrides.items() if k in policy_fields}}
    if "n_action_steps" in pol_kw:
        pol_kw["n_action_steps"] = min(pol_kw["n_action_steps"], cfg.action_horizon)
    try:
        pol_cfg = PolicyConfig(model=cfg, **pol_kw)
    except ValueError as e:
        raise UserError(f"{ckpt.directory}: {e}") from e
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in PI0Model(cfg).state_dict().items()}
    plan = plan_load(ckpt.shapes, expected)
    log.info("%s: %s layout, %s (%s / %s / %s), norm stats from %s (%s)", ckpt.directory, ckpt.layout,
             ckpt.model_type, cfg.paligemma.variant, cfg.action_expert.variant, cfg.vision.variant, found.source,
             s.normalization)
    return ForeignPlan(ckpt, pol_cfg, found.stats, {ours: ckpt.tensors[src] for ours, src in plan.items()})


def load_foreign_policy(directory: str | Path, device: str | torch.device = "cpu", norm_stats: str | Path | None = None,
                        tokenizer: str | Path | None = None, openpi_config: str | None = None,
                        delta_action_dims: int | None = None, openpi_bf16_params: bool = False,
                        **overrides: Any) -> Any:
    """A ``PI0Policy`` straight from an openpi-PyTorch / RLinf / LeRobot directory, each tensor read and cast on its
    own into a model allocated once on ``device`` (float32 unless ``dtype="bfloat16"``)."""
    from pi0.models.init import round_params_
    from pi0.policies.pi0 import PI0Policy
    from pi0.policies.tokenizer import PaligemmaTokenizer

    fp = plan_foreign(directory, norm_stats, openpi_config, delta_action_dims, **overrides)
    tok = PaligemmaTokenizer(find_tokenizer(fp.ckpt.directory, tokenizer), fp.policy_config.model.max_token_len)
    with torch.device("meta"):
        model = PI0Model(fp.policy_config.model)
    policy = PI0Policy(fp.policy_config, fp.stats, tok, model)  # validates before allocating
    model.to_empty(device=torch.device(device))
    checkpoint_io.load_entries_into(model, fp.sources)
    if openpi_bf16_params:
        round_params_(model, torch.bfloat16)
    return policy.eval()


def convert_foreign(directory: str | Path, output_path: str | Path, source: str, norm_stats: str | Path | None = None,
                    tokenizer: str | Path | None = None, dtype: str = "float32", openpi_config: str | None = None,
                    delta_action_dims: int | None = None, **overrides: Any) -> Path:
    """Write our policy directory from a ``source`` (openpi-pytorch | rlinf | lerobot) directory, one tensor at a
    time (read, cast, write), so peak memory is about one tensor beyond the interpreter."""
    from pi0.errors import PathExistsError
    from pi0.policies.pi0 import PI0Policy
    from pi0.policies.tokenizer import PaligemmaTokenizer, build_tokenizer_model
    from pi0.utils.checkpoint_io import SafetensorsWriter, atomic_directory

    if source not in FROM_CHOICES:
        raise UserError(f"--from must be one of {sorted(FROM_CHOICES)}, got {source!r}")
    output_path = Path(output_path)
    if output_path.exists() and any(output_path.iterdir()) and not (output_path / "config.json").is_file():
        raise PathExistsError(f"--output_path {output_path} exists and is not a policy directory; choose a new path")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise MissingPathError(f"--tokenizer {tokenizer} does not exist")
    fp = plan_foreign(directory, norm_stats, openpi_config, delta_action_dims, layouts=FROM_CHOICES[source],
                      dtype=dtype, **overrides)
    cfg = fp.policy_config.model
    if tokenizer is None and (fp.ckpt.directory / "tokenizer.model").is_file():
        tokenizer = fp.ckpt.directory / "tokenizer.model"
    with atomic_directory(output_path) as tmp_out:
        if tokenizer is None:  # as the JAX path does
            log.warning("no --tokenizer given: writing a small offline stand-in tokenizer; pass PaliGemma's "
                        "sentencepiece model for real checkpoints")
            build_tokenizer_model(tmp_out / "tokenizer.model")
        else:
            shutil.copyfile(tokenizer, tmp_out / "tokenizer.model")
        with torch.device("meta"):
            PI0Policy(fp.policy_config, fp.stats, PaligemmaTokenizer(tmp_out / "tokenizer.model", cfg.max_token_len),
                      PI0Model(cfg))  # checks
        specs = {f"model.{k}": (param_storage_dtype(k, cfg.dtype), e.shape) for k, (_, e) in fp.sources.items()}
        with SafetensorsWriter(tmp_out / "model.safetensors", specs) as writer:
            for k, (f, e) in fp.sources.items():
                t = checkpoint_io.read_tensor(f, e, k)
                writer.write(f"model.{k}", t.to(specs[f"model.{k}"][0]))
                del t
        (tmp_out / "config.json").write_text(json.dumps(fp.policy_config.to_dict(), indent=2))
        save_norm_stats(fp.stats, tmp_out / "norm_stats.json")
    return output_path


# ---------------------------------------------------------------------------------------------- writing openpi's format
def save_openpi_pytorch(policy: Any, directory: str | Path, dtype: str | None = None,
                        state: dict[str, torch.Tensor] | None = None,
                        asset_id: str = "physical-intelligence/libero") -> Path:
    """Write ``policy`` in openpi's PyTorch format: the keys, shapes and dtypes openpi's converter writes.

    as in openpi's convert_jax_model_to_pytorch.py: every tensor in one precision (``dtype``, default the policy's:
    bf16 for a bf16 policy, else float32), ``save_model``'s tied-weight metadata (embed_tokens stored as lm_head), the
    unused action-expert ``lm_head`` present (written as zeros), and config.json with action_dim, action_horizon, the
    variant names and precision; norm stats go to ``assets/<asset_id>/norm_stats.json`` where openpi looks for them.
    The tokenizer, normalization mode and delta dims are openpi train-config settings, not files: not written.
    A value head (training only) is left out; a CFG optimality embedding has no place in openpi and is refused.
    """
    from pi0.models.lora import merged_state_dict

    directory = Path(directory)
    cfg = policy.config.model
    precision = dtype or cfg.dtype
    if precision not in ("float32", "bfloat16"):
        raise UserError(f"dtype must be float32 or bfloat16, got {precision!r}")
    torch_dtype = torch.float32 if precision == "float32" else torch.bfloat16
    if state is None:
        state = merged_state_dict(policy.model)
    state = {k: v for k, v in state.items() if not k.startswith("value_head.")}
    names = {k: ours_to_openpi(k) for k in state}
    specs = {names[k]: (torch_dtype, tuple(t.shape)) for k, t in state.items()}
    specs[O_EXPERT_HEAD] = (torch_dtype, (cfg.vocab_size, cfg.action_expert.width))
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {O_EMBED: O_LM_HEAD}  # what safetensors' save_model records for the dropped tie (and nothing else)
    with checkpoint_io.SafetensorsWriter(directory / "model.safetensors", specs, metadata=metadata) as writer:
        for k, t in state.items():
            writer.write(names[k], t.detach().to(torch_dtype))
        writer.write_zeros(O_EXPERT_HEAD)
    (directory / "config.json").write_text(json.dumps({
        "action_dim": cfg.action_dim, "action_horizon": cfg.action_horizon, "paligemma_variant": cfg.paligemma.variant,
        "action_expert_variant": cfg.action_expert.variant, "precision": precision}, indent=2))
    assets = directory / "assets" / asset_id
    assets.mkdir(parents=True, exist_ok=True)
    save_norm_stats(policy.norm_stats, assets / "norm_stats.json")
    return directory
