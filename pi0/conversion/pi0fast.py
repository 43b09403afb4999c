"""openpi pi0-FAST params (flat name -> array) -> ``PI0FASTModel`` state dict, strictly; and the checkpoint driver.

A pi0-FAST tree is PaliGemma alone: ``PaliGemma/img/...`` (SigLIP + head) and ``PaliGemma/llm/...``
(one Gemma, no ``_1`` expert, no action projections). Layers are scanned (leading depth axis).
``convert_pi0_to_hf_lerobot.py`` dispatches here when ``is_pi0fast_tree`` holds.

What the tree cannot say is required up front, before any array is read: the FAST action tokenizer the
checkpoint was trained with (its action token ids are defined by it), and the action horizon / token budget
(``--openpi_config NAME`` or explicit flags). The converted config.json states ``decode_position_offset: 1``:
openpi serves pi0-FAST with decoded token s at position prefill_len + s + 1.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pi0.conversion.openpi_configs import OpenpiConfig, get_openpi_config, names_for
from pi0.conversion.pi0 import (OrbaxParams, find_norm_stats, gemma_config_from, gemma_rules, resolve_delta_action_dims,
                                siglip_config_from, siglip_rules)
from pi0.errors import MissingPathError, UserError
from pi0.models.pi0fast import PI0FASTModel, Pi0FASTConfig
from pi0.policies.fast_tokenizer import FASTTokenizer
from pi0.policies.normalize import load_norm_stats
from pi0.policies.pi0fast import FASTPolicyConfig, PI0FASTPolicy
from pi0.policies.tokenizer import PaligemmaTokenizer
from pi0.utils.checkpoint_io import atomic_directory

log = logging.getLogger(__name__)

Flat = dict[str, np.ndarray]
Rule = Callable[[np.ndarray], Iterator[tuple[str, np.ndarray]]]
LLM = "PaliGemma/llm/"
PI0_PREFIX = "paligemma_with_expert."  # pi0's torch keys start with it; PI0FASTModel's do not


def is_pi0fast_tree(keys: Any) -> bool:
    """True for openpi pi0-FAST parameter names: a PaliGemma LLM without the ``_1`` expert or action heads."""
    keys = [k.removeprefix("params/") for k in keys]
    has_llm = any(k.startswith(LLM) for k in keys)
    has_expert = any((k.startswith(LLM) and "_1" in k) or k.startswith(("action_", "state_proj")) for k in keys)
    return has_llm and not has_expert


def infer_fast_config(flat: Flat, **overrides: Any) -> Pi0FASTConfig:
    """Pi0FASTConfig from parameter shapes (the SigLIP and VLM-Gemma inference of pi0's converter); ``overrides``
    (Pi0FASTConfig fields) win."""
    try:
        cfg = dict(paligemma=gemma_config_from(flat, ""), vision=siglip_config_from(flat),
                   vocab_size=flat[f"{LLM}embedder/input_embedding"].shape[0])
    except KeyError as e:
        raise ValueError(f"not a pi0-FAST checkpoint: missing parameter {e.args[0]!r}") from e
    return Pi0FASTConfig(**{**cfg, **overrides})


def _rules() -> dict[str, Rule]:
    """openpi key -> fn(array) yielding (torch key, array) pairs: pi0's SigLIP and VLM-Gemma rules, with pi0's
    ``paligemma_with_expert.`` prefix dropped (``PI0FASTModel`` holds the PaliGemma alone)."""
    def strip(fn: Rule) -> Rule:
        return lambda a: ((k.removeprefix(PI0_PREFIX), t) for k, t in fn(a))

    return {key: strip(fn) for key, fn in (*siglip_rules(), *gemma_rules(0))}


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


FAST_TOKENIZER_HELP = (
    "a pi0-FAST checkpoint decodes actions with the FAST tokenizer it was trained with: pass --fast_tokenizer DIR, "
    "a local copy of the Hugging Face repo physical-intelligence/fast (processor_config.json + tokenizer.json; "
    "download it where the hub is reachable, e.g. `huggingface-cli download physical-intelligence/fast --local-dir "
    "DIR`). A stand-in tokenizer gives other action ids for every chunk, so the converted policy would output "
    "garbage; for a model of your own, fit one explicitly with `python -m pi0.policies.fast_tokenizer fit`")


FAST_FILES = ("processor_config.json", "tokenizer.json", "tokenizer_config.json")  # the last: the text clean-up


def load_fast_tokenizer(fast_tokenizer: str | Path | None) -> FASTTokenizer:
    """The FAST tokenizer of ``--fast_tokenizer``, or a one-line UserError saying where it comes from and what to
    pass (missing flag, missing files, unreadable files)."""
    if fast_tokenizer is None:
        raise UserError(f"missing --fast_tokenizer: {FAST_TOKENIZER_HELP}")
    path = Path(fast_tokenizer)
    missing = [f for f in FAST_FILES if not (path / f).is_file()]
    if not path.is_dir() or missing:
        raise MissingPathError(f"--fast_tokenizer {path} is not a FAST tokenizer directory (lacks "
                               f"{missing or 'the directory'}): {FAST_TOKENIZER_HELP}")
    try:
        return FASTTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file: say which directory, before any array is read
        raise UserError(f"--fast_tokenizer {path} cannot be read ({type(e).__name__}: {e}): {FAST_TOKENIZER_HELP}"
                        ) from None


def check_vocabularies(text: PaligemmaTokenizer, fast: FASTTokenizer, vocab_size: int) -> None:
    """UserError unless the text tokenizer covers the model vocabulary (openpi reads decoded ids back as text) and
    the FAST ids, mapped to ``vocab_size - 1 - 128 - t``, land above the 4 special ids."""
    if text.vocab_size < vocab_size:
        raise UserError(f"--tokenizer has {text.vocab_size} pieces but the checkpoint's vocabulary has {vocab_size}: "
                        f"pass the PaliGemma sentencepiece model the checkpoint was trained with")
    lowest = vocab_size - 1 - 128 - (fast.bpe_vocab_size - 1)
    if lowest < 4:
        raise UserError(f"--fast_tokenizer has {fast.bpe_vocab_size} tokens, more than fit below the last 128 ids of "
                        f"the checkpoint's {vocab_size}-id vocabulary: is it the tokenizer of this checkpoint?")


def resolve_fast_settings(preset: OpenpiConfig | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """action_horizon / max_token_len (/ action_dim) from explicit overrides, else the openpi preset; else refuse."""
    out = dict(overrides)
    for key in ("action_horizon", "max_token_len"):
        if out.get(key) is None:
            if preset is None:
                raise UserError(f"a pi0-FAST checkpoint does not record its {key}: pass --openpi_config NAME "
                                f"(one of {', '.join(names_for('pi0fast'))}) or --action_horizon and "
                                f"--max_token_len (openpi's pi0_fast_libero: 10 and 180)")
            out[key] = getattr(preset, key)
    if preset is not None and preset.action_dim is not None:
        out.setdefault("action_dim", preset.action_dim)
    return out


def convert_pi0fast_checkpoint(flat: Flat, output_path: str | Path, norm_stats_path: str | Path,
                               tokenizer: PaligemmaTokenizer, fast: FASTTokenizer, dtype: str = "float32",
                               delta_action_dims: int = 0, normalization: str = "quantile",
                               **overrides: Any) -> Path:
    """Write a ``PI0FASTPolicy`` directory from already-read flat params (atomically: temp dir + rename)."""
    stats = load_norm_stats(norm_stats_path)
    overrides.setdefault("action_dim", stats["actions"].dim)
    overrides.setdefault("decode_position_offset", 1)  # as openpi serves it (see Pi0FASTConfig)
    model = build_fast_model(flat, **overrides)
    pol_cfg = FASTPolicyConfig(model=model.cfg, delta_action_dims=delta_action_dims, normalization=normalization)
    policy = PI0FASTPolicy.build(pol_cfg, stats, tokenizer, fast, model)
    with atomic_directory(output_path) as tmp:
        policy.save_pretrained(tmp, dtype=dtype)
    return Path(output_path)


def maybe_convert_pi0fast(checkpoint_dir: str | Path, output_path: str | Path, norm_stats: str | Path | None = None,
                          tokenizer: str | Path | None = None, fast_tokenizer: str | Path | None = None,
                          dtype: str = "float32", delta_action_dims: int | None = None,
                          openpi_config: str | None = None, **overrides: Any) -> Path | None:
    """Convert ``checkpoint_dir`` if it holds a pi0-FAST tree (-> output path), else return None (not ours).

    Every input is checked from metadata before any array is read: both tokenizers (readable, and fitting the
    checkpoint's vocabulary), the horizon and token budget (explicit ``overrides`` win over ``openpi_config``), the
    norm stats and the delta-action dims (explicit, else the preset, else known from the asset id as for pi0).
    """

    params_dir = Path(checkpoint_dir)
    if not params_dir.is_dir():
        return None  # the pi0 converter reports a missing directory
    if not (params_dir / "_METADATA").exists() and (params_dir / "params" / "_METADATA").exists():
        params_dir = params_dir / "params"
    if not (params_dir / "_METADATA").exists():
        return None
    src = OrbaxParams(params_dir)  # metadata only
    if not is_pi0fast_tree(src.shapes):
        return None
    log.info("pi0-FAST parameter tree detected in %s", params_dir)
    preset = get_openpi_config(openpi_config, "pi0fast") if openpi_config else None
    fast = load_fast_tokenizer(fast_tokenizer)
    if tokenizer is None or not Path(tokenizer).is_file():
        what = "missing --tokenizer" if tokenizer is None else f"--tokenizer {tokenizer} is not a file"
        raise MissingPathError(f"{what}: a pi0-FAST checkpoint needs PaliGemma's sentencepiece model "
                               f"(paligemma_tokenizer.model, a local copy), since openpi reads the decoded action ids "
                               f"back as text")
    overrides = resolve_fast_settings(preset, {k: v for k, v in overrides.items() if v is not None})
    text = PaligemmaTokenizer(tokenizer, overrides["max_token_len"])
    check_vocabularies(text, fast, src.shapes[f"{LLM}embedder/input_embedding"][0])
    ns = Path(norm_stats) if norm_stats else find_norm_stats(params_dir)
    if ns is None or not ns.is_file():
        raise MissingPathError(f"no norm_stats.json under {params_dir.resolve().parent}/assets/*/; "
                               f"pass --norm_stats PATH")
    normalization = preset.normalization if preset else "quantile"  # openpi: every non-pi0 model uses quantiles
    if normalization == "quantile" and load_norm_stats(ns)["actions"].q01 is None:
        raise UserError(f"{ns} has no q01/q99, which pi0-FAST's quantile normalization needs (openpi computes them "
                        f"with scripts/compute_norm_stats.py)")
    if delta_action_dims is None and preset is not None:
        delta_action_dims = preset.delta_action_dims
    delta_action_dims = resolve_delta_action_dims(ns, delta_action_dims)
    return convert_pi0fast_checkpoint(src.read(list(src.shapes)), output_path, ns, text, fast, dtype, delta_action_dims=delta_action_dims, normalization=normalization,
                                      **overrides)
