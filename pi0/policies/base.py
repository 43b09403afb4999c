"""What every policy type shares: the directory format and its ``save_pretrained`` / ``from_pretrained``.

A policy directory holds ``model.safetensors`` (the model's tensors under ``model.``), ``config.json`` (the policy
config, with ``model_type`` for the loader), ``norm_stats.json`` and ``tokenizer.model``; a model type may add
files of its own (pi0-FAST: ``fast_tokenizer/``) through ``_save_extras`` / ``_load_extras``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import torch

from pi0.models.init import round_params_
from pi0.models.pi0 import param_storage_dtype
from pi0.policies.normalize import load_norm_stats, save_norm_stats
from pi0.policies.tokenizer import PaligemmaTokenizer
from pi0.utils import checkpoint_io


class PretrainedPolicy:
    """Mixin for a policy ``cls(config, norm_stats, tokenizer, model=..., **extras)`` with ``self.model``."""

    MODEL_TYPE: ClassVar[str]
    config_class: ClassVar[type]  # the policy config (has .model, to_dict / from_dict)
    model_config_class: ClassVar[type]  # the type of config.model
    model_class: ClassVar[type]  # the network, built from config.model

    config: Any
    model: torch.nn.Module
    norm_stats: Any
    tokenizer: PaligemmaTokenizer

    # ------------------------------------------------------------------ hooks
    def _save_extras(self, directory: Path) -> None:
        """Write files of this model type beside the common ones (none by default)."""

    @classmethod
    def _load_extras(cls, directory: Path, config: Any) -> dict[str, Any]:
        """Constructor arguments read from the files of this model type (none by default)."""
        return {}

    # ------------------------------------------------------------------ persistence
    def save_pretrained(self, directory: str | Path, dtype: str | None = None,
                        state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy directory; tensors are cast and written one at a time (no second model copy).

        ``dtype`` ("float32" | "bfloat16") re-types the saved weights; openpi's float32 parameters (norms,
        patch / position embeddings, pi0's small heads) stay float32 (``param_storage_dtype``). LoRA adapters are
        merged into their base weights (``pi0.models.lora.save_adapters`` writes the adapters alone). ``state``: the
        model's weights when they are not ``self.model``'s own (gathered from FSDP shards: ``pi0.ript.utils.fsdp``).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = self.config
        if dtype is not None and dtype != cfg.model.dtype:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
        from pi0.models.lora import merged_state_dict
        if state is None:
            state = merged_state_dict(self.model)  # LoRA adapters (if any) merged: a plain checkpoint
        specs = {f"model.{k}": (param_storage_dtype(k, cfg.model.dtype), tuple(t.shape)) for k, t in state.items()}
        with checkpoint_io.SafetensorsWriter(directory / "model.safetensors", specs) as writer:
            for k, t in state.items():
                writer.write(f"model.{k}", t.detach().to(specs[f"model.{k}"][0]))
        (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        save_norm_stats(self.norm_stats, directory / "norm_stats.json")
        if self.tokenizer.model_path.resolve() != (directory / "tokenizer.model").resolve():
            shutil.copyfile(self.tokenizer.model_path, directory / "tokenizer.model")
        self._save_extras(directory)
        return directory

    @classmethod
    def read_config(cls, directory: Path, overrides: dict[str, Any]) -> Any:
        """config.json of ``directory`` with ``overrides`` (policy-config or model-config fields) applied."""
        path = directory / "config.json"
        try:
            cfg_dict = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        kind = cfg_dict.get("model_type", "pi0")
        if kind != cls.MODEL_TYPE:
            raise ValueError(f"{path} has model_type {kind!r}, not {cls.MODEL_TYPE!r}: load it with "
                             f"pi0.policies.load_policy (it dispatches on model_type)")
        model_fields = {f.name for f in dataclasses.fields(cls.model_config_class)}
        policy_fields = {f.name for f in dataclasses.fields(cls.config_class)} - {"model"}
        bad = sorted(set(overrides) - model_fields - policy_fields)
        if bad:
            raise ValueError(f"from_pretrained: unknown override(s) {bad}; valid: {cls.config_class.__name__} fields "
                             f"{sorted(policy_fields)} or model fields {sorted(model_fields)}")
        cfg_dict["model"] = {**cfg_dict.get("model", {}), **{k: v for k, v in overrides.items() if k in model_fields}}
        cfg_dict.update({k: v for k, v in overrides.items() if k not in model_fields})
        try:
            return cls.config_class.from_dict(cfg_dict)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        openpi_bf16_params: bool = False, **overrides: Any) -> Any:
        """Load a directory written by ``save_pretrained`` or the converter.

        The model is built on the meta device, allocated once on ``device`` in its final dtypes, and every
        tensor is read from model.safetensors straight into it (peak memory about one checkpoint, no float32
        copy of a bf16 checkpoint, nothing on the CPU beyond one tensor when loading onto a GPU).
        ``overrides`` patch config.json (policy-config fields such as n_action_steps, or model-config fields
        such as dtype="bfloat16"). ``openpi_bf16_params`` rounds every weight through bf16 (float32 compute), as
        unmodified openpi serving restores params.
        """
        directory = Path(directory)
        files = checkpoint_io.check_policy_dir(directory)
        config = cls.read_config(directory, overrides)
        norm_stats = load_norm_stats(files["norm_stats.json"])
        tokenizer = PaligemmaTokenizer(files["tokenizer.model"], config.model.max_token_len)
        extras = cls._load_extras(directory, config)
        with torch.device("meta"):
            model = cls.model_class(config.model)  # parameters already in their final dtypes
        checkpoint_io.check_safetensors_matches(model, files["model.safetensors"], prefix="model.")
        policy = cls(config, norm_stats, tokenizer, model=model, **extras)  # validates before allocating
        model.to_empty(device=torch.device(device))
        checkpoint_io.load_safetensors_into(model, files["model.safetensors"], prefix="model.")
        if callable(getattr(model, "apply_precision", None)):  # e.g. pi0's bf16_precision="openpi" rounding
            model.apply_precision()
        if openpi_bf16_params:
            round_params_(model, torch.bfloat16)
        return policy.eval()
