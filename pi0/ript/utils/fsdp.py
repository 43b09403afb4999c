"""FSDP2 for pi0 under torchrun: parameters, gradients and optimizer state sharded over the ranks.

``algo.fsdp: true`` (with ``trainable: all``, the mode that needs it) shards the model with
``torch.distributed.fsdp.fully_shard``: one unit per transformer layer (every SigLIP encoder layer, every decoder layer
of both Gemmas) and a root unit for the rest (embeddings, projector, action heads). A rank holds 1/N of the float32
parameters, their gradients and AdamW's two moments (16 bytes a parameter / N), plus the one or two layers being
gathered at a time. With ``precision: bf16`` the float32 shards are the master weights and FSDP gathers them as bf16
for compute (``MixedPrecisionPolicy``; gradients reduced in float32); unlike the unsharded bf16 path the norms then
compute from bf16-rounded weights too.

pi0's joint attention runs the two Gemmas' layers side by side (``PaliGemmaWithExpert._layer``), calling each
decoder layer's ``start`` (norm + q/k/v) and ``finish`` (o-proj + MLP) rather than its ``forward``; both are
registered as FSDP forward methods, so each gathers the layer's weights (two gathers a layer: correct, at twice the
traffic of a plain layer). The root's entry points (``forward``, ``step_log_prob``, the samplers) are registered the
same way.

Rollouts and evaluation differ per rank (episode lengths, dynamic-sampling rounds), so they cannot run through
per-layer collectives: :func:`gathered` all-gathers every unit once (all ranks together), the ranks then sample
independently with no collective, and the shards are restored on exit.

Checkpoints: the weights are gathered to rank 0 and written as the usual ``model.safetensors`` (any world size or a
single process loads them); the optimizer state is written sharded by ``torch.distributed.checkpoint`` (one file per
rank, resumable at another world size). The no-deadlock rule of ``PolicyUpdate`` holds: a rank with fewer (or no)
minibatches runs zero-weighted ones, so every rank runs the same forwards, backwards and collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pi0.ript.utils.dist_utils import DistInfo

# PI0Model methods that run the network from outside (training losses, collection samplers)
ROOT_METHODS = ("step_log_prob", "sample_actions", "sample_actions_sde", "predict_velocity")


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` was sharded by :func:`shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, info: DistInfo, precision: str = "float32",
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard a ``PI0Model`` (cast to float32) in place over the ranks of ``info`` (module docstring) -> the same model.

    ``precision``: "float32", or "bf16" (bf16 compute from the float32 shards, float32 gradient reduction).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if not info.enabled:
        raise ValueError("algo.fsdp needs torchrun with more than one rank (one process: turn fsdp off)")
    if precision not in ("float32", "bf16"):
        raise ValueError(f"precision must be float32 or bf16, got {precision!r}")
    model.float()  # the shards are the float32 master weights
    if getattr(model, "fast_sampler", None) is not None:
        model.enable_fast_sampling(False)
    device = "cuda" if info.device.startswith("cuda") else "cpu"
    mesh = init_device_mesh(device, (info.world_size,))
    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.set_compute_dtype("bfloat16" if precision == "bf16" else "float32")  # activations; parameters stay float32
    kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    pwe = model.paligemma_with_expert
    for layer in pwe.paligemma.vision_tower.vision_model.encoder.layers:
        fully_shard(layer, **kw)
    for gemma in pwe.experts:
        for layer in gemma.layers:
            fully_shard(layer, **kw)
            register_fsdp_forward_method(layer, "start")
            register_fsdp_forward_method(layer, "finish")
    fully_shard(model, **kw)
    # start() returns q, k, v as views of the projections; FSDP2 warns about in-place ops on views, and pi0 only
    # consumes them out of place (torch.cat, RoPE), so the warning is noise here
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGemmaDecoderLayer\) returned a view")
    for name in ROOT_METHODS:
        register_fsdp_forward_method(model, name)
    return model


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every unit of a sharded model gathered for rank-local inference (collection, evaluation, videos); a no-op for
    an unsharded one. Entering is collective (every rank enters together); inside, forwards run no collective."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for m in units:
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
        model.set_reshard_after_forward(True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded float32 weights on the CPU on rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_policy(policy: Any, directory: str | Path, info: DistInfo) -> None:
    """``policy.save_pretrained(directory)`` on rank 0, gathering sharded weights first (every rank calls it)."""
    sharded = is_sharded(policy.model)
    state = full_state_dict(policy.model) if sharded else None
    if info.is_main:  # sharded: the float32 masters, so that a resumed run continues exactly
        policy.save_pretrained(directory, dtype="float32" if sharded else None, state=state)
    if info.enabled:
        dist.barrier()


def save_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Write ``optimizer``'s sharded state with torch.distributed.checkpoint (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(directory))


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Inverse of :func:`save_sharded_optimizer` (any world size; every rank calls it). Parameters that never had a
    gradient (the VLM's last-layer output path, unused by the action loss) have no saved state and keep a fresh one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(directory), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly DTensor) scalar such as a global gradient norm."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
