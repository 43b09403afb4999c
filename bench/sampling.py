"""Benchmark pi0 sample_actions: KV-cached prefix (run once) vs recomputing the prefix at every Euler step.

    python bench/sampling.py                                  # tiny config, CPU
    python bench/sampling.py --config full --device cuda --dtype bfloat16 --batch 1 --cameras 2
    python bench/sampling.py --paligemma gemma_2b --expert gemma_300m --vision So400m/14

Both paths run in this process on the same random weights and inputs; prints ms per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pi0.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.modeling_pi0 import PI0Model


def build(args: argparse.Namespace) -> Pi0Config:
    """Config from flags."""
    if args.config == "full":
        args.paligemma, args.expert, args.vision = "gemma_2b", "gemma_300m", "So400m/14"
        args.vocab = 257_152
    return Pi0Config(paligemma=GemmaConfig.from_variant(args.paligemma), action_expert=GemmaConfig.from_variant(args.expert),
                     vision=SiglipConfig.from_variant(args.vision), vocab_size=args.vocab, dtype=args.dtype,
                     attn_implementation=args.attn)


def timeit(fn, device: str, iters: int) -> list[float]:
    """Wall times in ms of ``iters`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    """Run both paths and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=["tiny", "full"], default="tiny")
    p.add_argument("--paligemma", default="dummy")
    p.add_argument("--expert", default="dummy")
    p.add_argument("--vision", default="mu/14")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cameras", type=int, default=2, help="unmasked cameras (of 3)")
    p.add_argument("--num_steps", type=int, default=10)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    cfg = build(args)
    torch.manual_seed(0)
    model = PI0Model(cfg).to(args.device).eval()
    b, s = args.batch, cfg.vision.image_size
    images = [torch.rand(b, 3, s, s, device=args.device) * 2 - 1 for _ in range(3)]
    masks = [torch.full((b,), i < args.cameras, device=args.device) for i in range(3)]
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_token_len), device=args.device)
    tmask = torch.arange(cfg.max_token_len, device=args.device)[None].expand(b, -1) < 12
    state = torch.randn(b, cfg.action_dim, device=args.device)
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, device=args.device)
    inputs = (images, masks, tokens, tmask, state, noise, args.num_steps)
    cached = timeit(lambda: model.sample_actions(*inputs), args.device, args.iters)
    naive = timeit(lambda: model.sample_actions_uncached(*inputs), args.device, args.iters)
    diff = (model.sample_actions(*inputs) - model.sample_actions_uncached(*inputs)).abs().max().item()
    c, n = statistics.median(cached), statistics.median(naive)
    print(f"config={args.config} paligemma={cfg.paligemma.variant} expert={cfg.action_expert.variant} "
          f"vision={cfg.vision.variant} dtype={cfg.dtype} attn={cfg.attn_implementation} device={args.device} "
          f"batch={b} cameras={args.cameras} steps={args.num_steps}")
    print(f"kv-cached prefix : {c:9.1f} ms/call (median of {args.iters})")
    print(f"recompute prefix : {n:9.1f} ms/call (median of {args.iters})")
    print(f"speed-up (recompute / cached) = {n / c:.2f}x   max |diff| = {diff:.2e}")


if __name__ == "__main__":
    main()
