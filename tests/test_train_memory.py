"""Training memory modes on a tiny pi0: LoRA (identity at init, frozen base, merged / adapter-only saves),
activation checkpointing (same gradients), bf16 compute with float32 masters (finite, close to float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pi0.models.lora import LoRALinear, apply_lora, is_lora_param, load_adapters, save_adapters
from pi0.policies.pi0 import PI0Policy, default_norm_stats
from pi0.ript.objectives import FlowMatchingObjective, PPOObjective
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.warm_start import TinyArenaConfig, tiny_arena_policy

CFG = TinyArenaConfig(image_size=28, depth=2, action_horizon=4, n_action_steps=2, num_steps=3)


def _policy(pi05: bool = False) -> PI0Policy:
    import dataclasses
    return tiny_arena_policy(dataclasses.replace(CFG, pi05=pi05), default_norm_stats(8, 7))


def _batch(pol: PI0Policy, b: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flow / PPO batch of ``b`` windows with random images, prompts, state and a recorded SDE chain."""
    g = torch.Generator().manual_seed(seed)
    size = pol.config.model.vision.image_size
    obs = {"image": {k: torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)
                     for k in pol.config.image_keys},
           "state": torch.randn(b, 8, generator=g), "prompt": ["push the red block onto the blue target"] * b}
    inp = pol.prepare_inputs(obs)
    m = pol.config.model
    with torch.no_grad():
        rec = pol.model.sample_actions_sde(inp["images"], inp["img_masks"], inp["lang_tokens"], inp["lang_masks"],
                                           inp["state"], torch.randn(b, m.action_horizon, m.action_dim, generator=g),
                                           pol.config.num_steps, 0.5, generator=g)
    mask = torch.zeros(b, m.action_horizon, m.action_dim)
    mask[:, :, :7] = 1.0
    return dict(images=inp["images"], img_masks=inp["img_masks"], lang_tokens=inp["lang_tokens"],
                lang_masks=inp["lang_masks"], state=inp["state"], actions=rec["chain"][:, -1], action_mask=mask,
                chain=rec["chain"], sde_step=torch.full((b,), int(rec["sde_step"])),
                logp_old=(rec["log_prob"] * mask).sum((1, 2)), advantage=torch.tensor([1.0, -1.0, 0.5][:b]),
                label=torch.zeros(b))


def _flow_loss(pol: PI0Policy, batch: dict) -> torch.Tensor:
    return FlowMatchingObjective(pol).loss(batch, torch.Generator().manual_seed(7))[0]


# ---------------------------------------------------------------------------------------------- LoRA
def test_lora_layer_hand_checked():
    lin = torch.nn.Linear(3, 2, bias=True)
    lora = LoRALinear.from_linear(lin, rank=1, alpha=2.0)
    assert lora.weight is lin.weight and lora.bias is lin.bias and lora.scaling == 2.0
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(lora(x), lin(x))  # B = 0: the same numbers
    with torch.no_grad():
        lora.lora_A.copy_(torch.tensor([[1.0, 0.0, -1.0]]))
        lora.lora_B.copy_(torch.tensor([[0.5], [1.0]]))
    # x A^T = 1 - 3 = -2; (x A^T) B^T = [-1, -2]; x 2.0
    torch.testing.assert_close(lora(x) - lin(x), torch.tensor([[-2.0, -4.0]]))
    torch.testing.assert_close(lora.delta(), 2.0 * torch.tensor([[0.5], [1.0]]) @ torch.tensor([[1.0, 0.0, -1.0]]))


def test_lora_is_identity_at_init_and_trains_only_adapters_and_heads(tmp_path):
    pol = _policy()
    batch = _batch(pol)
    before_loss = _flow_loss(pol, batch)
    n = apply_lora(pol.model)
    assert n == 2 * CFG.depth * 7  # q k v o gate up down, in both Gemmas
    vlm, expert = pol.model.paligemma_with_expert.experts
    assert (vlm.layers[0].self_attn.q_proj.rank, expert.layers[0].mlp.up_proj.rank) == (16, 32)  # openpi's ranks
    assert torch.equal(_flow_loss(pol, batch), before_loss)  # bit-identical at initialisation
    # the checkpoint keys of the base weights are unchanged (plain key map)
    assert "paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj.weight" in pol.model.state_dict()
    pol.model.set_trainable("lora")
    trainable = {k for k, p in pol.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_param(k) or not k.startswith("paligemma_with_expert.") for k in trainable)
    frozen = {k: p.detach().clone() for k, p in pol.model.named_parameters() if not p.requires_grad}
    upd = PolicyUpdate(PPOObjective(pol, 0.5), OptimizerConfig(lr=1e-2, minibatch_size=8))
    windows_batch = batch
    upd.objective.collate = lambda ws: windows_batch  # one pre-built batch as the minibatch
    st = upd.step([0, 1, 2])
    assert st["steps"] == 1
    for k, p in pol.model.named_parameters():
        if k in frozen:
            assert torch.equal(p, frozen[k]), k  # every base weight bit-identical
    assert not torch.equal(expert.layers[0].self_attn.q_proj.lora_B, torch.zeros_like(expert.layers[0].self_attn.q_proj.lora_B))
    # merged save: a plain checkpoint (no adapter keys) that computes what the adapted model computes
    pol.eval()
    want = _flow_loss(pol, batch)
    merged = PI0Policy.from_pretrained(pol.save_pretrained(tmp_path / "merged"))
    assert not any(is_lora_param(k) for k in merged.model.state_dict())
    torch.testing.assert_close(_flow_loss(merged, batch), want, rtol=1e-5, atol=1e-5)
    # adapters alone: onto the base weights they were trained from
    base_dir = tmp_path / "base"
    base = _policy()
    base.save_pretrained(base_dir)
    save_adapters(pol.model, tmp_path / "adapters")
    loaded = PI0Policy.from_pretrained(base_dir)
    load_adapters(loaded.model, tmp_path / "adapters")
    torch.testing.assert_close(_flow_loss(loaded, batch), want, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="save_adapters"):
        load_adapters(_policy().model, tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("pi05", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(pi05):
    pol = _policy(pi05)
    batch = _batch(pol)
    grads = {}
    for on in (False, True):
        pol.model.zero_grad(set_to_none=True)
        pol.model.set_gradient_checkpointing(on)
        loss = _flow_loss(pol, batch) + PPOObjective(pol, 0.5).loss(batch)[0]  # joint forward + KV-cache path
        loss.backward()
        grads[on] = {k: p.grad.clone() for k, p in pol.model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 20
    worst = max(float((grads[True][k] - grads[False][k]).abs().max()) for k in grads[True])
    assert worst <= 1e-6, worst


# ---------------------------------------------------------------------------------------------- mixed precision
def test_bf16_step_is_finite_close_to_float32_and_keeps_float32_masters():
    torch.manual_seed(0)
    ref = _policy()
    batch = _batch(ref)
    deltas, losses = {}, {}
    for prec in ("float32", "bf16"):
        pol = _policy()
        pol.model.load_state_dict(ref.model.state_dict())
        if prec == "bf16":
            pol.model.set_dtype("bfloat16")
            pol.config.model = pol.model.cfg
        pol.model.set_trainable("expert")
        frozen = {k: p.detach().clone() for k, p in pol.model.named_parameters() if not p.requires_grad}
        upd = PolicyUpdate(FlowMatchingObjective(pol), OptimizerConfig(lr=1e-3, minibatch_size=8))
        upd.objective.collate = lambda ws: batch
        st = upd.step([0, 1, 2])
        assert st["steps"] == 1 and np.isfinite(st["loss"])
        losses[prec] = st["loss"]
        start = ref.model.state_dict()
        deltas[prec] = torch.cat([(p.detach().float() - start[k].float()).reshape(-1)
                                  for k, p in pol.model.named_parameters() if p.requires_grad])
        assert all(torch.equal(p, frozen[k]) for k, p in pol.model.named_parameters() if k in frozen)
        if prec == "bf16":
            bf = [p for p in upd.params if p.dtype == torch.bfloat16]
            assert bf and all(m.dtype == torch.float32 for m in upd.masters)  # float32 masters of bf16 weights
            assert all(p.dtype == torch.bfloat16 for k, p in pol.model.named_parameters()
                       if k in frozen and "q_proj" in k)  # the frozen weights stay bf16
            for p, m in zip(upd.params, upd.masters):  # each step writes the masters back, rounded
                assert torch.equal(p, m.to(p.dtype))
    assert abs(losses["bf16"] - losses["float32"]) <= 0.05 * abs(losses["float32"])
    cos = torch.nn.functional.cosine_similarity(deltas["bf16"], deltas["float32"], dim=0)
    assert cos > 0.9, float(cos)


def test_train_memory_bench_runs_each_mode_in_a_fresh_process(tmp_path):
    """bench/train_memory.py on the tiny model (bf16, random weights): one update step per mode, each in a fresh
    process, the table and the last line (bench/memory.py's ci config takes ~100 s a bf16 step on an AVX2-only CPU)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / "bench" / "train_memory.py"), "--config", "tiny", "--random_init",
                        "--work", str(tmp_path), "--modes", "expert", "lora", "--checkpointing", "on", "--threads", "1",
                        "--minibatch", "2", "--json", str(tmp_path / "rows.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"expert=([0-9.]+) lora=([0-9.]+)", last)
    assert m, last
    import json
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(x["mode"], x["steps"]) for x in rows] == [("expert", 1.0), ("lora", 1.0)]
    # each child trained what its mode names: the counts of the same model built here
    from pi0.models.config import Pi0Config
    from pi0.models.pi0 import PI0Model

    def trainable(mode: str) -> int:
        with torch.device("meta"):
            model = PI0Model(Pi0Config.tiny(dtype="bfloat16")).set_trainable(mode)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    assert [x["trainable_params"] for x in rows] == [trainable("expert"), trainable("lora")]
    assert trainable("expert") < trainable("all")
