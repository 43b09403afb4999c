"""Parameter initialisation for training a model from scratch (tiny arena policies, pi0 and pi0-FAST), and the
bf16 rounding of openpi's serving."""

from __future__ import annotations

import torch
from torch import nn

from pi0.models.gemma import AdaRMSNorm, RMSNorm

INIT_MODES = ("noisy", "scratch")  # random_init of PI0Policy / PI0FASTPolicy: parity init | to train from scratch


def check_init_mode(init: str) -> None:
    """Raise a ValueError naming the allowed modes for an unknown ``random_init(init=...)``."""
    if init not in INIT_MODES:
        raise ValueError(f"init must be one of {INIT_MODES}, got {init!r}")


@torch.no_grad()
def scratch_init_(model: nn.Module, gen: torch.Generator) -> None:
    """Initialise ``model`` in place for training from scratch (not for parity).

    LayerNorms start as the identity (weight 1, bias 0), Gemma RMSNorms too (their scale is ``1 + w``, so
    w = 0), biases and the optimality embedding at 0, linear/conv weights N(0, 1/fan_in) (LeCun), embedding
    tables N(0, 1/width). The noisy parity init of ``PI0Policy.random_init`` scales every SigLIP LayerNorm by
    ~N(0, 0.1), which leaves a tiny vision tower nearly blind to the images it is trained on.
    """
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.weight.zero_()
        elif isinstance(mod, nn.LayerNorm):
            mod.weight.fill_(1.0)
            mod.bias.zero_()
        elif isinstance(mod, (nn.Linear, nn.Conv2d)):
            fan_in = mod.weight[0].numel()
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * fan_in ** -0.5)
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, nn.Embedding):
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * mod.weight.shape[1] ** -0.5)
    for mod in model.modules():  # as in openpi gemma.py: the adaRMS modulation starts at zero
        if isinstance(mod, AdaRMSNorm):
            mod.dense.weight.zero_()
            mod.dense.bias.zero_()
    if getattr(model, "optimality_embedding", None) is not None:
        model.optimality_embedding.zero_()


@torch.no_grad()
def round_params_(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Round every weight through ``dtype`` in place, keeping its storage dtype.

    Unmodified openpi serving (create_trained_policy -> restore_params(dtype=bfloat16)) runs a float32 model on
    bf16-rounded weights; this reproduces those numbers exactly.
    """
    for p in model.parameters():
        p.copy_(p.to(dtype).to(p.dtype))
    return model
