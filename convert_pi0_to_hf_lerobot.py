r"""Convert an openpi JAX pi0 / pi0-FAST checkpoint into a PyTorch policy directory (safetensors).

Adds: exact weight conversion, streamed (leaf groups restored from orbax, each tensor mapped, cast and written
at once: peak memory about the output size, a full-size pi0 converts on a 16 GB machine). The config is inferred
from parameter shapes; flags may override it.

    pip install -e '.[convert]'      # CPU jax + orbax-checkpoint, only needed here
    python convert_pi0_to_hf_lerobot.py --checkpoint_dir <openpi ckpt>/params --output_path ckpts/pi0_libero \
        --openpi_config pi0_libero [--tokenizer paligemma_tokenizer.model] [--norm_stats PATH] [--dtype bfloat16]
    python convert_pi0_to_hf_lerobot.py --checkpoint_dir <pi0_fast_libero ckpt>/params \
        --output_path ckpts/pi0_fast_libero --openpi_config pi0_fast_libero --tokenizer paligemma_tokenizer.model \
        --fast_tokenizer <local copy of physical-intelligence/fast>

From a PyTorch checkpoint (openpi's PyTorch format, RLinf's layout, LeRobot's pi0 / pi05), one tensor at a time:

    python convert_pi0_to_hf_lerobot.py --from openpi-pytorch --checkpoint_dir <openpi pytorch dir> \
        --output_path ckpts/pi0_libero --openpi_config pi0_libero --tokenizer paligemma_tokenizer.model
    python convert_pi0_to_hf_lerobot.py --from rlinf --checkpoint_dir <RLinf-Pi05-... dir> \
        --output_path ckpts/pi05_rlinf --openpi_config pi05_libero --tokenizer paligemma_tokenizer.model
    python convert_pi0_to_hf_lerobot.py --from lerobot --checkpoint_dir <lerobot pi0 dir> --output_path ckpts/pi0_lr

Norm stats are searched in a stated order (``pi0.conversion.foreign_files.NORM_STATS_ORDER``) unless
``--norm_stats`` names them. Such a directory also loads directly: ``load_policy(dir, tokenizer=...)``.

A pi0-FAST tree is detected from its parameter names. ``--openpi_config NAME`` (pi0_libero, pi0_fast_libero,
pi0_droid, pi0_fast_droid) sets what the tree cannot say: horizon, token budget, normalization, delta dims.
Writes model.safetensors + config.json + norm_stats.json + tokenizer.model (+ fast_tokenizer/); load it with
``pi0.policies.load_policy(output_path)``. (Single process; no torchrun needed.)
"""

from __future__ import annotations

import argparse
import logging
import time

from pi0.conversion.openpi_pytorch import convert_foreign
from pi0.conversion.pi0 import convert_checkpoint
from pi0.conversion.pi0fast import maybe_convert_pi0fast
from pi0.errors import UserError, run_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI config."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_dir", required=True,
                   help="openpi <ckpt>/params (orbax), or with --from a PyTorch checkpoint directory")
    p.add_argument("--from", dest="source", default="openpi-jax",
                   choices=["openpi-jax", "openpi-pytorch", "rlinf", "lerobot"],
                   help="layout of --checkpoint_dir (default openpi-jax: orbax params); the PyTorch layouts are "
                        "checked against the files")
    p.add_argument("--output_path", required=True, help="output PI0Policy directory")
    p.add_argument("--norm_stats", default=None, help="norm_stats.json (default: <ckpt>/assets/*/norm_stats.json)")
    p.add_argument("--tokenizer", default=None, help="PaliGemma sentencepiece model (local path)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--paligemma_variant", default=None, help="override the inferred VLM Gemma (e.g. gemma_2b)")
    p.add_argument("--action_expert_variant", default=None, help="override the inferred expert (e.g. gemma_300m)")
    p.add_argument("--vision_variant", default=None, help="override the inferred SigLIP (e.g. So400m/14)")
    p.add_argument("--openpi_config", default=None,
                   help="openpi TrainConfig the checkpoint was trained with (pi0_libero, pi0_fast_libero, pi0_droid, "
                        "pi0_fast_droid): sets horizon, token length, normalization and delta dims")
    p.add_argument("--action_horizon", type=int, default=None,
                   help="override (not inferable from shapes; pi0-FAST needs it or --openpi_config)")
    p.add_argument("--max_token_len", type=int, default=None,
                   help="override (pi0 default 48; pi0-FAST needs it or --openpi_config)")
    p.add_argument("--delta_action_dims", type=int, default=None,
                   help="leading action dims predicted as deltas to the state (6 for openpi's LIBERO asset, "
                        "found automatically; required for any other asset: 0 = absolute, e.g. DROID)")
    p.add_argument("--fast_tokenizer", default=None,
                   help="pi0-FAST (required): the FAST tokenizer the checkpoint was trained with, a local copy of "
                        "physical-intelligence/fast (processor_config.json + tokenizer.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the conversion."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    overrides = {k: v for k in ("paligemma_variant", "action_expert_variant", "vision_variant",
                                                   "action_horizon", "max_token_len") if (v := getattr(args, k)) is not None}
    t0 = time.perf_counter()
    if args.source != "openpi-jax":
        if args.fast_tokenizer:
            raise UserError("--fast_tokenizer is for openpi JAX pi0-FAST checkpoints; --from reads pi0 / pi0.5 only")
        out = convert_foreign(args.checkpoint_dir, args.output_path, args.source, norm_stats=args.norm_stats,
                              tokenizer=args.tokenizer, dtype=args.dtype, openpi_config=args.openpi_config,
                              delta_action_dims=args.delta_action_dims,
                              **{k: v for k, v in overrides.items() if k != "vision_variant"})
        print(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
        return
    out = maybe_convert_pi0fast(  # a pi0-FAST tree is detected from the checkpoint metadata and converted here
        args.checkpoint_dir, args.output_path, args.norm_stats, args.tokenizer, args.fast_tokenizer, args.dtype,
        args.delta_action_dims, args.openpi_config,
        **{k: v for k, v in overrides.items() if k in ("action_horizon", "max_token_len")}
    ) or convert_checkpoint(args.checkpoint_dir, args.output_path, norm_stats=args.norm_stats,
                             tokenizer=args.tokenizer, dtype=args.dtype, delta_action_dims=args.delta_action_dims,
                             openpi_config=args.openpi_config, **overrides)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    run_cli(main)
