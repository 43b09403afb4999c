"""Peak memory and time of one full-size RL update step per training mode, each in a fresh process.

    python bench/train_memory.py                           # expert, lora, all; checkpointing on and off; CPU
    python bench/train_memory.py --modes expert lora --checkpointing on
    python bench/train_memory.py --device cuda --minibatch 8    # torch.cuda.max_memory_allocated on a GPU

The model is the full-size pi0 (3.24 B parameters) converted from openpi's params tree written as zeros
(``bench/memory.py --steps write convert``, the shapes of ``../shared/golden/openpi_pi0_full_shapes.json``), loaded
in bf16 (openpi's mixed precision: bf16 weights and activations, float32 norms and heads). One step is the RL
recipe's default objective (LOOP: the PPO-clipped Flow-SDE log-density ratio) on ``--minibatch`` windows with 2 camera
images (+ the padded third camera, as LIBERO runs), through ``pi0.ript.update.PolicyUpdate`` (AdamW on float32
masters of the trainable weights). Modes (``PI0Model.set_trainable``): ``expert`` (SigLIP and the VLM frozen, the
prefix without gradient), ``lora`` (openpi's ranks on both Gemmas), ``all``. Reported per run: peak RSS (VmHWM of the
process) on CPU, ``max_memory_allocated`` on CUDA, the step's seconds, the trainable parameter count; a watchdog kills
a CPU run above ``--limit_gb`` and the table says so (with the estimate of weights + masters + AdamW state + grads).
A second table gives the computed per-GPU state of ``all`` under FSDP2 (``algo.fsdp``, ``pi0.ript.utils.fsdp``) over
N GPUs: float32 master shards, gradient shards and AdamW moments (16 bytes a parameter / N) plus the bf16 copies
FSDP2 gathers (the root unit, held through the forward, and two transformer layers), activations not included.
The last line is ``<mode>=<peak GiB> ...`` for the modes run with checkpointing on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def child(args: argparse.Namespace) -> dict:
    """One update step in this fresh process -> its measurements."""
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO))
    from pi0.modeling_pi0 import PI0Policy
    from pi0.ript.objectives import PPOObjective
    from pi0.ript.update import OptimizerConfig, PolicyUpdate
    from pi0.utils.memory import vm_status

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if args.random_init:  # built on the device with PyTorch's default init: same shapes, dtypes and memory
        from pi0.models.pi0 import PI0Model
        from pi0.policies.pi0 import PolicyConfig, default_norm_stats
        from pi0.policies.presets import tiny_tokenizer

        pcfg = PolicyConfig(model=model_config(args.config))
        with dev:
            model = PI0Model(pcfg.model)
        pol = PI0Policy(pcfg, default_norm_stats(8, 7), tiny_tokenizer(pcfg.model.max_token_len), model=model)
    else:
        pol = PI0Policy.from_pretrained(Path(args.work) / "converted_bfloat16", device=dev, dtype="bfloat16")
    m = pol.model
    m.set_trainable(args.mode)
    m.set_gradient_checkpointing(args.checkpointing == "on")
    n_train = sum(p.numel() for p in m.parameters() if p.requires_grad)
    cfg = pol.config.model
    b, g = args.minibatch, np.random.default_rng(0)
    size = cfg.vision.image_size
    windows = [dict(image=g.integers(0, 256, (size, size, 3), dtype=np.uint8),
                    wrist_image=g.integers(0, 256, (size, size, 3), dtype=np.uint8),
                    state=g.standard_normal(cfg.action_dim).astype(np.float32),
                    tokens=g.integers(0, 1000, cfg.max_token_len), token_mask=np.ones(cfg.max_token_len, bool),
                    actions=np.zeros((cfg.action_horizon, cfg.action_dim), np.float32),
                    action_mask=np.ones((cfg.action_horizon, cfg.action_dim), np.float32),
                    chain=g.standard_normal((pol.config.num_steps + 1, cfg.action_horizon, cfg.action_dim)
                                            ).astype(np.float32),
                    sde_step=int(g.integers(0, pol.config.num_steps)), logp_old=0.0, label=0.0,
                    advantage=float(1 - 2 * (i % 2)), step=0) for i in range(b)]
    upd = PolicyUpdate(PPOObjective(pol, 0.5), OptimizerConfig(lr=1e-5, minibatch_size=b))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    st = upd.step(windows)
    sec = time.perf_counter() - t0
    out = {"mode": args.mode, "checkpointing": args.checkpointing, "device": args.device, "minibatch": b,
           "trainable_params": n_train, "step_s": round(sec, 1), "steps": st["steps"], "peak_rss": vm_status("VmHWM")}
    if dev.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def model_config(config: str):
    """The bf16 Pi0Config of ``--config`` (full: pi0's; ci: bench/memory.py's small one; tiny: the tests' model, a
    check that the bench runs rather than a measurement) for ``--random_init``."""
    import dataclasses

    from pi0.models.config import Pi0Config

    if config == "full":
        return Pi0Config(dtype="bfloat16")
    if config == "tiny":
        return Pi0Config.tiny(dtype="bfloat16")
    sys.path.insert(0, str(REPO / "bench"))
    from memory import ci_config

    return dataclasses.replace(ci_config(), dtype="bfloat16")


def estimate(mode: str, n_train: int, total: int) -> float:
    """GiB of weights (bf16) + float32 masters, AdamW moments and gradients of what trains (no activations)."""
    return (2 * total + (4 + 8 + 4) * n_train) / GIB


def fsdp_estimate(sizes: dict[str, int], n: int) -> float:
    """GiB per rank of FSDP2 over ``n`` ranks (module docstring) from parameter counts per tensor name."""
    layers: dict[str, int] = {}
    root = 0
    for k, c in sizes.items():
        if ".layers." in k:
            unit = k.split(".layers.")[0] + ".layers." + k.split(".layers.")[1].split(".")[0]
            layers[unit] = layers.get(unit, 0) + c
        else:
            root += c
    total = sum(sizes.values())
    return (16 * total / n + 2 * root + 2 * 2 * max(layers.values())) / GIB


def run(args: argparse.Namespace, mode: str, ck: str) -> dict:
    """``mode`` in a fresh subprocess under a watchdog -> its record (or a 'killed' one)."""
    sys.path.insert(0, str(REPO))
    from pi0.utils.memory import run_watched

    cmd = [sys.executable, __file__, "--_child", "--mode", mode, "--checkpointing", ck, "--work", args.work,
           "--device", args.device, "--minibatch", str(args.minibatch), "--threads", str(args.threads),
           "--config", args.config, *(["--random_init"] if args.random_init else [])]
    r = run_watched(cmd, args.limit_gb * GIB if args.device == "cpu" else None)
    if r.killed:
        return {"mode": mode, "checkpointing": ck, "killed": True, "peak_rss": r.polled_rss, "seconds": r.seconds}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} (checkpointing {ck}) failed with exit code {r.returncode}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["expert", "lora", "all"], choices=["expert", "lora", "all"])
    p.add_argument("--checkpointing", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--minibatch", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--work", default="/tmp/pi0_memory", help="where bench/memory.py writes / converts the zeros tree")
    p.add_argument("--config", default="full", choices=["full", "ci", "tiny"],
                   help="ci: bench/memory.py's small config; tiny: the tests' model (with --random_init)")
    p.add_argument("--limit_gb", type=float, default=21.0, help="CPU watchdog")
    p.add_argument("--json", default="", help="also write the records here")
    p.add_argument("--random_init", action="store_true",
                   help="the --config model built on --device with random weights, no zeros checkpoint to write "
                        "and convert first (what the GPU suite uses: the memory is the same)")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config == "tiny" and not args.random_init:
        p.error("--config tiny needs --random_init (bench/memory.py writes only the ci and full zeros trees)")
    if args._child:
        args.checkpointing = args.checkpointing[0] if isinstance(args.checkpointing, list) else args.checkpointing
        print(json.dumps(child(args)), flush=True)
        return
    if args.random_init:
        import torch

        sys.path.insert(0, str(REPO))
        from pi0.models.pi0 import PI0Model

        with torch.device("meta"):
            params = dict(PI0Model(model_config(args.config)).named_parameters())
        sizes = {k: v.numel() for k, v in params.items()}
        ckpt_gib = sum(v.numel() * v.element_size() for v in params.values()) / GIB
    else:
        ckpt = Path(args.work) / "converted_bfloat16"
        if not (ckpt / "model.safetensors").is_file():  # the full-size zeros tree, converted (a few minutes, once)
            subprocess.run([sys.executable, str(REPO / "bench" / "memory.py"), "--steps", "write", "convert",
                            "--dtypes", "bfloat16", "--work", args.work, "--config", args.config, "--keep"],
                           check=True)
        ckpt_gib = (ckpt / "model.safetensors").stat().st_size / GIB
        from safetensors import safe_open
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            sizes = {k: int(np_prod(f.get_slice(k).get_shape())) for k in f.keys()}
    total = sum(sizes.values())
    rows = []
    for mode in args.modes:
        for ck in args.checkpointing:
            r = run(args, mode, ck)
            rows.append(r)
            peak = r.get("cuda_max_allocated", r["peak_rss"]) / GIB
            tag = "KILLED at" if r.get("killed") else ""
            print(f"{mode:6s} checkpointing {ck:3s}: {tag} peak {peak:.2f} GiB ({peak / ckpt_gib:.2f}x the bf16 "
                  f"checkpoint), step {r.get('step_s', '-')} s, trainable {r.get('trainable_params', 0) / 1e6:.0f} M",
                  flush=True)
    print(f"\n| mode | checkpointing | peak {'CUDA allocated' if args.device != 'cpu' else 'RSS'} (GiB) | x ckpt "
          f"| step (s) | trainable (M) | estimate w/o activations (GiB) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        peak = r.get("cuda_max_allocated", r["peak_rss"]) / GIB
        n = r.get("trainable_params")
        est = f"{estimate(r['mode'], n, total):.1f}" if n else "-"
        print(f"| {r['mode']} | {r['checkpointing']} | {'> ' if r.get('killed') else ''}{peak:.2f} | "
              f"{peak / ckpt_gib:.2f} | {r.get('step_s', '-')} | {n / 1e6 if n else 0:.0f} | {est} |")
    print(f"(bf16 checkpoint {ckpt_gib:.2f} GiB, {total / 1e9:.2f} B parameters; load average {os.getloadavg()})")
    print("\n| all + FSDP2, GPUs | per-GPU params + grads + AdamW + gathered bf16 (GiB, computed, w/o activations) |"
          "\n|---|---|")
    for n in (1, 2, 4, 8):
        print(f"| {n} | {fsdp_estimate(sizes, n):.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "checkpoint_gib": ckpt_gib, "params": total}, indent=1))
    last = [r for r in rows if r["checkpointing"] == "on"]
    print(" ".join(f"{r['mode']}={'>' if r.get('killed') else ''}"
                   f"{r.get('cuda_max_allocated', r['peak_rss']) / GIB:.1f}" for r in last))


def np_prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


if __name__ == "__main__":
    main()
