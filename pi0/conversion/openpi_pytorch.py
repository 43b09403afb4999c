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

Names and shapes: ``pi0.conversion.foreign_keys``; what a directory holds: ``pi0.conversion.foreign_files``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pi0.conversion.foreign_files import Checkpoint, detect, find_norm_stats, find_tokenizer, resolve_settings
from pi0.conversion.foreign_keys import (FOREIGN_LAYOUTS, FROM_CHOICES, O_EMBED, O_EXPERT_HEAD, O_LM_HEAD,
                                         infer_config, ours_to_openpi, plan_load)
from pi0.errors import MissingPathError, UserError
from pi0.models.config import Pi0Config
from pi0.models.pi0 import PI0Model, param_storage_dtype
from pi0.policies.normalize import NormStats, save_norm_stats
from pi0.utils import checkpoint_io
from pi0.utils.checkpoint_io import TensorEntry

log = logging.getLogger(__name__)

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
