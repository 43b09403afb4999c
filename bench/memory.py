"""Peak memory of converting, loading and running pi0, each step in a fresh subprocess.

    python bench/memory.py                                   # full-size pi0 (3.24 B params), bf16, /tmp/pi0_memory
    python bench/memory.py --dtypes bfloat16 float32 --steps write convert load sample random_init
    python bench/memory.py --config ci --json out.json       # ~300 MB config (what tests/test_memory.py runs)
    python bench/memory.py --code /path/to/other/checkout    # the same steps on another version of `pi0`
    python bench/memory.py --stored_dtype float32 --steps write convert   # openpi tree stored in float32
    python bench/memory.py --model pi05 --steps write convert load   # full-size pi0.5 (3.35 B params)
    python bench/memory.py --source openpi-pytorch --steps write convert load load_direct   # openpi's PyTorch format

Writes openpi's params tree as zeros (orbax: a few hundred KB on disk; ``--source openpi-pytorch``: openpi's PyTorch
``model.safetensors`` as a sparse file of zeros), converts it with the real converter (``--from`` there), loads
it with ``PI0Policy.from_pretrained``, runs one bf16 ``sample_actions`` on CPU, and builds ``random_init`` of the bf16
config. Each step runs in its own process and reports its peak RSS (VmHWM of
its own address space) and the RSS right after imports; a watchdog kills a step above ``--limit_gb``.
Printed next to the checkpoint size: peak, peak minus import baseline, and the goals' ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def _load_memory_utils():
    """``pi0/utils/memory.py`` of THIS checkout, loaded by path: a step run with ``--code`` must import the other
    checkout's ``pi0`` package, so this one is not put on ``sys.path``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_pi0_memory_utils", REPO / "pi0" / "utils" / "memory.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


_mem = _load_memory_utils()
run_watched, vm_status = _mem.run_watched, _mem.vm_status


def ci_config(pi05: bool = False):
    """A few hundred MB of pi0 (bf16): same structure as the real model, smaller widths and vocab."""
    from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig

    return Pi0Config(paligemma=GemmaConfig(1024, 4, 4096, 8, 1, 128), action_expert=GemmaConfig(512, 4, 2048, 8, 1, 128),
                     vision=SiglipConfig.from_variant("B/16"), vocab_size=32_000, pi05=pi05)


# ---------------------------------------------------------------------------------------------- steps (child side)
def step(name: str, work: Path, dtype: str, config: str, stored: str, model: str = "pi0",
         source: str = "openpi-jax") -> dict:
    """Run one step in this (fresh) process; returns its measurements."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    import pi0
    from pi0.models.config import Pi0Config
    from pi0.modeling_pi0 import PI0Policy, PolicyConfig, default_norm_stats

    from pi0.policies.presets import tiny_tokenizer

    # Warm-up, so the baseline holds the constant costs every step pays whatever the model size: sentencepiece,
    # CPU kernels, and torch's meta-tensor decompositions (~70 MB of Python modules imported on first meta init).
    tiny_tokenizer()
    torch.nn.Linear(8, 8)(torch.randn(2, 8)).to(torch.bfloat16).sum()
    with torch.device("meta"):
        torch.nn.Embedding(4, 4)
    pi05 = model == "pi05"
    cfg = (Pi0Config(pi05=True, action_horizon=10, max_token_len=200) if pi05 else Pi0Config()) if config == "full" \
        else ci_config(pi05)  # pi0.5: pi05_libero's horizon and token budget (the weights are the same)
    ckpt, out = work / f"openpi_ckpt_{stored}", work / f"converted_{dtype}"
    if source == "openpi-pytorch":
        ckpt = work / f"openpi_pytorch_{stored}"
    base, t0, info = vm_status("VmRSS"), time.perf_counter(), {}
    if name == "write" and source == "openpi-pytorch":
        from pi0.conversion.zero_checkpoint import write_zero_openpi_pytorch

        write_zero_openpi_pytorch(cfg, ckpt, dtype=stored)
    elif name == "convert" and source == "openpi-pytorch":
        from pi0.conversion.openpi_pytorch import convert_foreign

        convert_foreign(ckpt, out, "openpi-pytorch", dtype=dtype, openpi_config="pi05_libero" if pi05 else "pi0_libero",
                        paligemma=cfg.paligemma, action_expert=cfg.action_expert)  # (ci: custom sizes, no name)
    elif name == "load_direct":  # openpi-pytorch: load_policy on openpi's directory itself, bf16, no conversion
        from pi0.policies import load_policy

        load_policy(ckpt, dtype="bfloat16", tokenizer=tiny_tokenizer().model_path,
                    openpi_config="pi05_libero" if pi05 else "pi0_libero",
                    paligemma=cfg.paligemma, action_expert=cfg.action_expert)
    elif name == "write":
        from pi0.conversion.zero_checkpoint import openpi_param_shapes, write_zero_checkpoint

        write_zero_checkpoint(openpi_param_shapes(cfg), ckpt, dtype=stored)
    elif name == "convert":
        from pi0.conversion.pi0 import convert_checkpoint

        convert_checkpoint(ckpt / "params", out, dtype=dtype,
                           **({"openpi_config": "pi05_libero"} if pi05 else {"delta_action_dims": 6}))
    elif name == "load":
        PI0Policy.from_pretrained(out)
    elif name == "sample":  # one bf16 sample_actions on CPU, batch 1, 3 cameras
        pol = PI0Policy.from_pretrained(out, dtype="bfloat16")
        m, g = pol.model.cfg, torch.Generator().manual_seed(0)
        imgs = [torch.rand(1, 3, 224, 224, generator=g) * 2 - 1 for _ in range(3)]
        t1 = time.perf_counter()
        with torch.no_grad():
            pol.model.sample_actions(imgs, [torch.ones(1, dtype=torch.bool)] * 3,
                                     torch.randint(0, 1000, (1, m.max_token_len), generator=g),
                                     torch.ones(1, m.max_token_len, dtype=torch.bool),
                                     torch.randn(1, m.action_dim, generator=g),  # (pi0.5 ignores the state)
                                     torch.randn(1, m.action_horizon, m.action_dim, generator=g), num_steps=10)
        info["sample_actions_s"] = round(time.perf_counter() - t1, 1)
    elif name == "random_init":
        pol_cfg = PolicyConfig(model=dataclasses.replace(cfg, dtype="bfloat16"))
        PI0Policy.random_init(pol_cfg, default_norm_stats(), tiny_tokenizer())
    else:
        raise ValueError(f"unknown step {name!r}")
    return {"step": name, "dtype": dtype, "seconds": round(time.perf_counter() - t0, 1), "base_rss": base,
            "peak_rss": vm_status("VmHWM"), "pi0": pi0.__file__, **info}


# ---------------------------------------------------------------------------------------------- driver (parent side)
def run_step(name: str, args: argparse.Namespace, dtype: str) -> dict:
    """Run ``name`` in a fresh subprocess under a watchdog -> its measurements (or a 'killed' record)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.code if name != "write" else str(REPO),
                                                      os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--_step", name, "--work", str(args.work), "--config", args.config,
           "--dtypes", dtype, "--stored_dtype", args.stored_dtype, "--model", args.model, "--source", args.source]
    r = run_watched(cmd, args.limit_gb * GIB, env=env)
    if r.killed:
        return {"step": name, "dtype": dtype, "killed": True, "peak_rss": r.polled_rss, "seconds": r.seconds}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"step {name} ({dtype}) failed with exit code {r.returncode}")
    return {**json.loads(lines[-1]), "polled_rss": r.polled_rss}


def main() -> None:
    """Run the steps, print a table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="full", choices=["full", "ci"])
    p.add_argument("--model", default="pi0", choices=["pi0", "pi05"])
    p.add_argument("--source", default="openpi-jax", choices=["openpi-jax", "openpi-pytorch"],
                   help="the zero checkpoint's format: openpi's orbax params or openpi's PyTorch model.safetensors")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--steps", nargs="+", default=["write", "convert", "load", "sample", "random_init"])
    p.add_argument("--stored_dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the zero openpi tree (openpi's released params are float32 on disk)")
    p.add_argument("--work", type=Path, default=Path("/tmp/pi0_memory"))
    p.add_argument("--limit_gb", type=float, default=16.0, help="kill a step whose RSS exceeds this")
    p.add_argument("--code", default=str(REPO), help="checkout whose `pi0` the convert/load/sample steps use")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the converted checkpoints")
    p.add_argument("--_step", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._step:
        print(json.dumps(step(args._step, args.work, args.dtypes[0], args.config, args.stored_dtype, args.model,
                              args.source)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in args.dtypes:
        for name in args.steps:
            if name in ("write", "random_init", "sample") and dtype != args.dtypes[0]:
                continue  # dtype-independent steps run once
            r = run_step(name, args, dtype)
            st = args.work / f"converted_{dtype}" / "model.safetensors"
            r["ckpt_bytes"] = st.stat().st_size if st.exists() else None
            rows.append(r)
            size = r["ckpt_bytes"]
            extra = ("KILLED above limit" if r.get("killed") else
                     f"net {(r['peak_rss'] - r['base_rss']) / GIB:6.2f} GiB" +
                     (f"  peak/ckpt {r['peak_rss'] / size:.2f}  (peak-ckpt) {(r['peak_rss'] - size) / GIB:+.2f} GiB"
                      if size else ""))
            label = f"stored {args.stored_dtype}" if name == "write" else f"{'bfloat16' if name == 'sample' else dtype}"
            print(f"{name:12s} {label:15s} peak {r['peak_rss'] / GIB:6.2f} GiB  {extra}  "
                  f"ckpt {size / GIB if size else 0:5.2f} GiB  {r['seconds']:7.1f} s"
                  + (f"  (sample_actions {r['sample_actions_s']} s)" if "sample_actions_s" in r else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.keep:
        for dtype in args.dtypes:
            shutil.rmtree(args.work / f"converted_{dtype}", ignore_errors=True)


if __name__ == "__main__":
    main()
