"""What a foreign checkpoint directory holds, read from headers and small files: its layout (``detect``), norm
stats (``find_norm_stats``), the policy settings they imply (``resolve_settings``) and the tokenizer."""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pi0.conversion.foreign_keys import LEGACY_BUFFERS, O_PG, P, Shapes, canonical_key, is_pi05
from pi0.conversion.openpi_configs import get_openpi_config, names_for
from pi0.errors import MissingPathError, UserError
from pi0.policies.normalize import NormStats, Stats, load_norm_stats
from pi0.utils import checkpoint_io
from pi0.utils.checkpoint_io import TensorEntry

log = logging.getLogger(__name__)

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

