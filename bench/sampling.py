"""Benchmark pi0 sampling: recompute vs KV-cached (eager), FastSampler, compiled, CUDA-graph-captured; roofline.

    python bench/sampling.py                                  # tiny config, CPU: eager recompute vs KV-cached
    python bench/sampling.py --compile                        # + FastSampler eager / compiled (+ CUDA graph on GPU)
    python bench/sampling.py --config full --device cuda --dtype bfloat16 --batch 1 --cameras 2 --compile \
        --compile_prefix --attn sdpa                          # + compiled SigLIP/prefix, CUDA-graph rows
    python bench/sampling.py --config mid --profile           # per-stage latency table of one call (torch.profiler)
    python bench/sampling.py --fast --count_ops --threads 1   # + FastSampler with/without fused layers, ops per call
    python bench/sampling.py --config full --device cuda --dtype bfloat16 --batch 32 --sde --compile --compile_prefix \
        --graph_rows_only --scopes call,loop                  # Flow-SDE as RL collects; whole-call vs loop-only graphs

Every path runs in this process on the same random weights and inputs; prints ms per call, chunks per second,
ratios against the eager paths, max |diff| against the eager KV-cached path, and a roofline: bytes of weights one call reads
divided by the measured bandwidth of a large copy, with the fraction of it the fastest path achieves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.models.fast_sampler import FastSampler
from pi0.models.roofline import copy_bandwidth, weight_bytes_per_call
from pi0.modeling_pi0 import PI0Model

# name -> (paligemma, expert, vision, vocab); "mid" is a 4-layer 2B-width model for CPU profiles.
CONFIGS = {"tiny": ("dummy", "dummy", "mu/14", 1024), "full": ("gemma_2b", "gemma_300m", "So400m/14", 257_152),
           "mid": (GemmaConfig(1024, 4, 4096, 8, 1, 128), GemmaConfig(512, 4, 2048, 8, 1, 128), "B/16", 16_384)}


def build(args: argparse.Namespace) -> Pi0Config:
    """Config from flags (--config picks a preset; --paligemma/--expert/--vision/--vocab override 'tiny')."""
    pg, ex, vis, vocab = CONFIGS[args.config]
    if args.config == "tiny":
        pg, ex, vis, vocab = args.paligemma or pg, args.expert or ex, args.vision or vis, args.vocab or vocab
    gemma = lambda v: v if isinstance(v, GemmaConfig) else GemmaConfig.from_variant(v)  # noqa: E731
    return Pi0Config(paligemma=gemma(pg), action_expert=gemma(ex), vision=SiglipConfig.from_variant(vis),
                     vocab_size=vocab, dtype=args.dtype, attn_implementation=args.attn, pi05=args.pi05,
                     **({"action_horizon": 10, "max_token_len": 200} if args.pi05 else {}))  # pi05_libero's


def sync(device: str) -> None:
    """Wait for queued device work (CUDA) so wall time covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fns: dict[str, Callable[[], torch.Tensor]], device: str, iters: int
           ) -> dict[str, tuple[list[float], list[float]]]:
    """(wall ms, process CPU ms) of ``iters`` calls of each fn, interleaved round-robin (load hits all alike).

    On a shared CPU the process CPU time (all threads) is the steadier figure; on CUDA use the wall time.
    """
    for fn in fns.values():  # warm-up: compilation / graph capture happen here
        fn()
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            sync(device)
            t, c = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            out[name][0].append((time.perf_counter() - t) * 1000)
            out[name][1].append((time.process_time() - c) * 1000)
    return out


def count_ops(fn: Callable[[], torch.Tensor], device: str) -> dict[str, int]:
    """Operators one call launches (torch.profiler, after a warm-up call): "top" = aten ops dispatched from Python
    (a composite op counts once), "all" = every aten op including those a composite op dispatches inside, and on
    CUDA "kernels" = device kernels launched."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(device)
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    out = {"top": len(top), "all": len(aten)}
    if device.startswith("cuda"):
        out["kernels"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


def profile_table(sampler: FastSampler, inputs: tuple, device: str) -> None:
    """One profiled FastSampler call -> ms per stage (SigLIP, prefix, each denoise step) from torch.profiler."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sampler(*inputs)  # warm
    sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        sampler(*inputs)
        sync(device)
        wall = (time.perf_counter() - t) * 1000
    rows = {e.key: e for e in prof.key_averages() if e.key.startswith("pi0.")}
    order = sorted(rows, key=lambda k: (not k.startswith("pi0.models.siglip"), not k.startswith("pi0.prefix"),
                                        int(k.rsplit("_", 1)[-1]) if k[-1].isdigit() else -1))
    dev = device.startswith("cuda")
    print(f"\nprofile of one call (wall {wall:.1f} ms; host time per stage{' + device time' if dev else ''}):")
    print(f"  {'stage':<22}{'host ms':>10}" + (f"{'device ms':>12}" if dev else ""))
    for k in order:
        e = rows[k]
        line = f"  {k.removeprefix('pi0.'):<22}{e.cpu_time_total / 1000:>10.2f}"
        if dev:
            line += f"{getattr(e, 'device_time_total', getattr(e, 'cuda_time_total', 0.0)) / 1000:>12.2f}"
        print(line)
    print(f"  {'sum of stages':<22}{sum(rows[k].cpu_time_total for k in order) / 1000:>10.2f}")


def main() -> None:
    """Run the paths and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--paligemma", default=None, help="Gemma variant for --config tiny (default dummy)")
    p.add_argument("--expert", default=None)
    p.add_argument("--vision", default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"], help="as the policy (default sdpa)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cameras", type=int, default=2, help="unmasked cameras (of 3)")
    p.add_argument("--prompt_len", type=int, default=12, help="valid prompt tokens (of max_token_len=48)")
    p.add_argument("--num_steps", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--compile", action="store_true", help="add FastSampler, compiled and (CUDA) graph-captured rows")
    p.add_argument("--fast", action="store_true",
                   help="add the FastSampler rows without torch.compile: fused layers (default) and fuse_layers=False")
    p.add_argument("--count_ops", action="store_true",
                   help="count the operators one call of each path launches (torch.profiler; see count_ops)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--compile_prefix", action="store_true", help="compiled rows also compile SigLIP + prefix pass")
    p.add_argument("--skip_compile", action="store_true",
                   help="with --compile: the FastSampler and eager CUDA-graph rows only, no torch.compile (at full "
                        "size its first calls take minutes)")
    p.add_argument("--no_recompute", action="store_true", help="skip the slow recompute-prefix baseline")
    p.add_argument("--profile", action="store_true", help="print a per-stage latency table of one call")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--pi05", action="store_true", help="the pi0.5 architecture (adaRMS time conditioning)")
    p.add_argument("--sde", action="store_true",
                   help="time Flow-SDE sampling as RL collects (noise level 1.0, stochastic step 0, seeded draws) "
                        "instead of the deterministic sampler")
    p.add_argument("--scopes", default="call,loop",
                   help="CUDA-graph scopes with rows (FastSampler graph_scope): call = the whole call in one graph, "
                        "loop = the Euler loop only")
    p.add_argument("--graph_rows_only", action="store_true",
                   help="with --compile on CUDA: skip the un-captured FastSampler and compiled rows (GPU time)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = build(args)
    dev = args.device
    torch.manual_seed(0)
    with torch.device(dev):  # built and initialised on the device: a full-size init on the host takes a minute
        model = PI0Model(cfg).eval()
    b, s = args.batch, cfg.vision.image_size
    images = [torch.rand(b, 3, s, s, device=dev) * 2 - 1 for _ in range(3)]
    masks = [torch.full((b,), i < args.cameras, device=dev) for i in range(3)]
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_token_len), device=dev)
    tmask = torch.arange(cfg.max_token_len, device=dev)[None].expand(b, -1) < args.prompt_len
    state = torch.randn(b, cfg.action_dim, device=dev)
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, device=dev)
    inputs = (images, masks, tokens, tmask, state, noise, args.num_steps)
    print(f"config={args.config} paligemma={cfg.paligemma.variant}/{cfg.paligemma.width} expert="
          f"{cfg.action_expert.variant}/{cfg.action_expert.width} vision={cfg.vision.variant} dtype={cfg.dtype} "
          f"attn={cfg.attn_implementation} device={dev} batch={b} cameras={args.cameras} "
          f"prompt_len={args.prompt_len} steps={args.num_steps} threads={torch.get_num_threads()}")

    scopes = [x for x in args.scopes.split(",") if x]

    def run(sampler) -> Callable[[], torch.Tensor]:
        """One call of ``sampler`` (the model or a FastSampler) -> its chunk: deterministic, or Flow-SDE with the
        same seeded draw on every call (so every path's chunk is comparable)."""
        if not args.sde:
            return lambda: (sampler.sample_actions if sampler is model else sampler)(*inputs)
        return lambda: sampler.sample_actions_sde(*inputs[:6], num_steps=args.num_steps, noise_level=1.0, sde_step=0,
                                                  generator=torch.Generator().manual_seed(0))["actions"]

    ref = run(model)()
    paths: dict[str, Callable[[], torch.Tensor]] = {}
    if not args.no_recompute and not args.sde:
        paths["eager recompute"] = lambda: model.sample_actions_uncached(*inputs)
    paths["eager kv-cached"] = run(model)
    notes: dict[str, str] = {}
    cuda = dev.startswith("cuda")
    if (args.compile or args.fast) and not (args.graph_rows_only and cuda):
        unfused = FastSampler(model, cuda_graph=False, fuse_layers=False)
        paths["fast unfused layers"] = run(unfused)
        fast = FastSampler(model, cuda_graph=False)
        paths["fast (no compile)"] = run(fast)
    if args.compile:
        opts = dict(compile=True, backend=args.backend, compile_prefix=args.compile_prefix)
        if not args.skip_compile and not (args.graph_rows_only and cuda):
            t0 = time.perf_counter()
            compiled = FastSampler(model, cuda_graph=False, **opts)
            run(compiled)()
            notes["compiled"] = f"first call incl. compile {time.perf_counter() - t0:.1f} s"
            paths["compiled"] = run(compiled)
        if cuda:
            for label, kw in ([] if args.skip_compile else [("compiled", opts)]) + [("eager", {})]:
                for scope in scopes:
                    name = f"{label} + cuda graph ({scope})"
                    t0 = time.perf_counter()
                    graphed = FastSampler(model, cuda_graph=True, graph_scope=scope, **kw)
                    run(graphed)()
                    if graphed.graph_error is None and graphed.graph_scope == scope:
                        paths[name] = run(graphed)
                        notes[name] = f"first call incl. capture{' and compile' if kw else ''} " \
                                      f"{time.perf_counter() - t0:.1f} s"
                    else:
                        notes[name] = f"capture failed: {graphed.graph_error}"
        else:
            notes["cuda graph"] = "skipped (no CUDA device)"

    ops = {name: count_ops(fn, dev) for name, fn in paths.items()} if args.count_ops else {}
    times = timeit(paths, dev, args.iters)
    ms = {name: statistics.median(w) for name, (w, _) in times.items()}
    cpu = {name: statistics.median(c) for name, (_, c) in times.items()}
    diffs = {name: (fn() - ref).abs().max().item() for name, fn in paths.items()}
    base_r, base_c = ms.get("eager recompute"), ms["eager kv-cached"]
    chunks = {name: b * 1000.0 / t for name, t in ms.items()}
    print(f"\n{'path':<30}{'ms/call':>10}{'chunks/s':>10}{'vs recompute':>14}{'vs kv-cached':>14}{'cpu ms':>10}"
          f"{'cpu vs kv':>11}{'max|diff|':>11}")
    for name, t in ms.items():
        vr = f"{base_r / t:13.2f}x" if base_r else f"{'-':>14}"
        print(f"{name:<30}{t:10.1f}{chunks[name]:10.1f}{vr}{base_c / t:13.2f}x{cpu[name]:10.1f}"
              f"{cpu['eager kv-cached'] / cpu[name]:10.2f}x{diffs[name]:11.1e}")
    print(f"(median of {args.iters}; ms/chunk is wall time, cpu ms the process CPU time of the call)")
    if ops:
        base = ops["eager kv-cached"]["top"]
        kern = "kernels" in ops["eager kv-cached"]
        head = f"\n{'path':<30}{'ops/call':>10}{'vs kv-cached':>14}{'incl. nested':>14}"
        print(head + (f"{'kernels':>10}" if kern else ""))
        for name, o in ops.items():
            row = f"{name:<30}{o['top']:10d}{o['top'] / base:13.2f}x{o['all']:14d}"
            print(row + (f"{o['kernels']:10d}" if kern else ""))
        print("(ops/call: aten ops dispatched by one call, torch.profiler; incl. nested: with those composite ops "
              "dispatch inside)")
    for name, note in notes.items():
        print(f"  {name}: {note}")

    parts = weight_bytes_per_call(model, args.num_steps, args.cameras)
    bw = copy_bandwidth(dev)
    floor = parts["total"] / bw * 1000
    best = min(ms, key=ms.get)
    print(f"\nroofline: {parts['total'] / 1e9:.3f} GB of weights per call (siglip {parts['siglip'] / 1e9:.3f}, "
          f"gemma prefix {parts['gemma_prefix'] / 1e9:.3f}, expert x{args.num_steps + 1} {parts['expert'] / 1e9:.3f})"
          f" / measured copy bandwidth {bw / 1e9:.1f} GB/s = {floor:.2f} ms floor")
    print(f"achieved: {best} {ms[best]:.1f} ms = {floor / ms[best]:.2%} of the bandwidth roofline")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "pi05": args.pi05, "device": dev, "dtype": cfg.dtype, "batch": b, "cameras": args.cameras,
                       "num_steps": args.num_steps, "iters": args.iters, "sde": args.sde, "ms": ms,
                       "chunks_per_s": chunks, "max_abs_diff": diffs, "ops": ops,
                       "notes": notes, "weight_gb_per_call": parts["total"] / 1e9, "copy_gb_per_s": bw / 1e9,
                       "roofline_ms": floor, "best": best, "best_over_roofline": ms[best] / floor}, f, indent=2)

    if args.profile:
        prof = FastSampler(model, compile=args.compile, backend=args.backend, cuda_graph=False,
                           compile_prefix=args.compile and args.compile_prefix)
        profile_table(prof, inputs, dev)


if __name__ == "__main__":
    main()
