"""Benchmark pi0-FAST autoregressive decoding against pi0 flow sampling on the same tiny config.

    python bench/fast_decode.py                       # Gemma 'dummy' + SigLIP mu/14, CPU, 32 decoded tokens
    python bench/fast_decode.py --device cuda --batch 4 --steps 48 --iters 5

One process, same Gemma / SigLIP sizes, same images and prompt for both models (random weights):
  - pi0: ``sample_actions`` (prefix KV cache + ``num_steps`` Euler steps) and the uncached variant;
  - pi0-FAST: ``sample_tokens`` with the KV cache and without (whole sequence recomputed every token).
Early stopping is disabled (random weights rarely emit EOS; a trained model stops after ~30-40 tokens on
LIBERO-sized chunks), so exactly ``--steps`` tokens are decoded. Prints ms per call and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.modeling_pi0 import PI0Model
from pi0.modeling_pi0fast import PI0FASTModel, Pi0FASTConfig


def timeit(fn, device: str, iters: int) -> float:
    """Median wall time in ms of ``iters`` calls after one warm-up call."""
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
    return statistics.median(out)


def main() -> None:
    """Build both tiny models, time them, print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemma", default="dummy")
    p.add_argument("--vision", default="mu/14")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt_len", type=int, default=64, help="valid text tokens (prompt + state) of the prefix")
    p.add_argument("--steps", type=int, default=32, help="decoded FAST tokens")
    p.add_argument("--num_steps", type=int, default=10, help="pi0 Euler steps")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skip_uncached", action="store_true", help="skip the slow no-KV-cache decoding")
    args = p.parse_args()
    torch.manual_seed(0)
    dev, b, n = args.device, args.batch, args.prompt_len
    gemma, vision = GemmaConfig.from_variant(args.gemma), SiglipConfig.from_variant(args.vision)
    pi0 = PI0Model(Pi0Config(paligemma=gemma, action_expert=gemma, vision=vision, vocab_size=1024,
                             max_token_len=n + 16, attn_implementation="eager")).to(dev).eval()
    fast = PI0FASTModel(Pi0FASTConfig(paligemma=gemma, vision=vision, vocab_size=1024, max_token_len=n + 16,
                                      max_decoding_steps=args.steps)).to(dev).eval()
    images = [torch.rand(b, 3, 224, 224, device=dev) * 2 - 1 for _ in range(3)]
    masks = [torch.ones(b, dtype=torch.bool, device=dev)] * 2 + [torch.zeros(b, dtype=torch.bool, device=dev)]
    tokens = torch.randint(4, 1000, (b, n + 16), device=dev)
    tmask = torch.zeros(b, n + 16, dtype=torch.bool, device=dev)
    tmask[:, :n] = True
    state = torch.randn(b, 32, device=dev)
    noise = torch.randn(b, 50, 32, device=dev)
    with torch.no_grad():
        t_pi0 = timeit(lambda: pi0.sample_actions(images, masks, tokens, tmask, state, noise, args.num_steps), dev,
                       args.iters)
        t_pi0_nc = timeit(lambda: pi0.sample_actions_uncached(images, masks, tokens, tmask, state, noise,
                                                              args.num_steps), dev, args.iters)
        t_fast = timeit(lambda: fast.sample_tokens(images, masks, tokens, tmask, args.steps, early_stop=False), dev,
                        args.iters)
        t_fast_nc = None if args.skip_uncached else timeit(
            lambda: fast.sample_tokens(images, masks, tokens, tmask, args.steps, use_kv_cache=False,
                                      early_stop=False), dev,
            max(1, args.iters // 3))
    print(f"device {dev}, batch {b}, gemma {args.gemma}, vision {args.vision}, prefix {2 * 256} image + {n} text "
          f"tokens (+1 masked camera)")
    print(f"pi0 flow ({args.num_steps} Euler steps)     cached: {t_pi0:9.1f} ms   uncached: {t_pi0_nc:9.1f} ms")
    print(f"pi0-FAST ({args.steps} tokens)          cached: {t_fast:9.1f} ms   uncached: "
          + ("skipped" if t_fast_nc is None else f"{t_fast_nc:9.1f} ms"))
    print(f"ratio pi0-FAST / pi0 (both KV-cached):   {t_fast / t_pi0:6.2f}x")
    print(f"per decoded token / per Euler step:      {(t_fast / args.steps) / (t_pi0 / args.num_steps):6.2f}x")
    if t_fast_nc is not None:
        print(f"ratio pi0-FAST no cache / with cache:    {t_fast_nc / t_fast:6.2f}x")
        print(f"ratio pi0-FAST no cache / pi0 cached:    {t_fast_nc / t_pi0:6.2f}x")
    print(f"ratio pi0 no cache / with cache:         {t_pi0_nc / t_pi0:6.2f}x")


if __name__ == "__main__":
    main()
