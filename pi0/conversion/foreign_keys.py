"""Foreign PyTorch pi0 / pi0.5 checkpoints, by name: the layouts, the plain key map to ours and back, and the
architecture read from tensor shapes. Pure functions of names and shapes (no file is opened here)."""

from __future__ import annotations

import math
import re
from typing import Any

from pi0.errors import UserError
from pi0.models.config import GEMMA_VARIANTS, SIGLIP_VARIANTS, GemmaConfig, Pi0Config, SiglipConfig

Shapes = dict[str, tuple[int, ...]]  # tensor name -> shape

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


