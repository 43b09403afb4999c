"""openpi -> PyTorch key map (hand-computed), strictness, config inference and numerical parity."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import PI0_TINY, REPO, model_inputs
from pi0.models.config import Pi0Config
from pi0.conversion.pi0 import convert_params, infer_config, key_rules, read_orbax_params
from pi0.modeling_pi0 import PI0Model, PI0Policy

CFG = Pi0Config.tiny()


def _apply(key, arr):
    return dict(key_rules(CFG)[key](arr))


def test_q_einsum_hand_computed():
    w = np.arange(12, dtype=np.float32).reshape(1, 2, 3, 2)  # (L=1, N=2, D=3, H=2): w[n,d,h] = 6n + 2d + h
    out = _apply("PaliGemma/llm/layers/attn/q_einsum/w", w)
    expected = np.array([[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]], dtype=np.float32)  # row n*H + h, col d
    np.testing.assert_array_equal(out["paligemma_with_expert.paligemma.language_model.model.layers.0.self_attn.q_proj.weight"],
                                  expected)


def test_kv_gating_and_out_hand_computed():
    kv = np.arange(12, dtype=np.float32).reshape(1, 2, 1, 3, 2)  # (L, 2, K=1, D=3, H=2)
    out = _apply("PaliGemma/llm/layers/attn/kv_einsum_1/w", kv)
    pre = "paligemma_with_expert.gemma_expert.model.layers.0.self_attn."
    np.testing.assert_array_equal(out[pre + "k_proj.weight"], [[0, 2, 4], [1, 3, 5]])
    np.testing.assert_array_equal(out[pre + "v_proj.weight"], [[6, 8, 10], [7, 9, 11]])
    o = np.arange(12, dtype=np.float32).reshape(1, 2, 2, 3)  # (L, N=2, H=2, D=3) -> (D, N*H)
    out = _apply("PaliGemma/llm/layers/attn/attn_vec_einsum/w", o)
    np.testing.assert_array_equal(out["paligemma_with_expert.paligemma.language_model.model.layers.0.self_attn.o_proj.weight"],
                                  [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])
    g = np.arange(12, dtype=np.float32).reshape(1, 2, 2, 3)  # (L, 2, D=2, F=3)
    out = _apply("PaliGemma/llm/layers/mlp/gating_einsum", g)
    mlp = "paligemma_with_expert.paligemma.language_model.model.layers.0.mlp."
    np.testing.assert_array_equal(out[mlp + "gate_proj.weight"], [[0, 3], [1, 4], [2, 5]])
    np.testing.assert_array_equal(out[mlp + "up_proj.weight"], [[6, 9], [7, 10], [8, 11]])


def test_siglip_and_heads_hand_computed():
    k = np.arange(8, dtype=np.float32).reshape(2, 4)  # Dense (in=2, out=4) -> Linear weight (4, 2)
    np.testing.assert_array_equal(_apply("state_proj/kernel", k)["state_proj.weight"], k.T)
    conv = np.arange(2 * 2 * 3 * 1, dtype=np.float32).reshape(2, 2, 3, 1)  # HWIO -> OIHW
    w = _apply("PaliGemma/img/embedding/kernel", conv)[
        "paligemma_with_expert.paligemma.vision_tower.vision_model.embeddings.patch_embedding.weight"]
    assert w.shape == (1, 3, 2, 2) and w[0, 2, 1, 0] == conv[1, 0, 2, 0]
    q = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)  # (L, W=3, N=2, H=2) -> (N*H, W)
    out = _apply("PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel", q)
    np.testing.assert_array_equal(
        out["paligemma_with_expert.paligemma.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"],
        [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]])


def test_einsum_semantics_match_linear():
    """The mapped q weight computes openpi's einsum('BTD,NDH->BTNH')."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(1, 4, 6, 3)).astype(np.float32)
    x = rng.normal(size=(2, 5, 6)).astype(np.float32)
    ref = np.einsum("btd,ndh->btnh", x, w[0])
    weight = _apply("PaliGemma/llm/layers/attn/q_einsum/w", w)[
        "paligemma_with_expert.paligemma.language_model.model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose((x @ weight.T).reshape(2, 5, 4, 3), ref, atol=1e-5)


@pytest.fixture(scope="module")
def flat():
    return read_orbax_params(PI0_TINY / "checkpoint" / "params")


def test_infer_config_from_shapes(flat):
    cfg = infer_config(flat)
    assert cfg.paligemma.variant == "dummy" and cfg.action_expert.variant == "dummy"
    assert cfg.vision.variant == "mu/14" and cfg.vision.num_patches == 256
    assert (cfg.vocab_size, cfg.action_dim, cfg.action_horizon) == (1024, 32, 50)


def test_strict_mapping_names_the_key(flat):
    cfg = infer_config(flat)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in PI0Model(cfg).state_dict().items()}
    with pytest.raises(ValueError, match="PaliGemma/llm/bogus/w"):
        convert_params({**flat, "PaliGemma/llm/bogus/w": np.zeros(3)}, cfg, expected)
    missing = dict(flat)
    del missing["action_out_proj/bias"]
    with pytest.raises(ValueError, match="action_out_proj.bias"):
        convert_params(missing, cfg, expected)
    wrong = dict(expected)
    wrong["state_proj.weight"] = (64, 8)
    with pytest.raises(ValueError, match="shape mismatch for state_proj.weight"):
        convert_params(flat, cfg, wrong)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_parity_float32(converted_tiny, pi0_reference, attn):
    model = PI0Policy.from_pretrained(converted_tiny, attn_implementation=attn).model
    assert model.cfg.attn_implementation == attn
    ref, inp = pi0_reference, model_inputs(pi0_reference)
    noise = torch.from_numpy(ref["noise"])
    actions = model.sample_actions(**inp, noise=noise, num_steps=int(ref["num_steps"]))
    assert np.abs(actions.numpy() - ref["actions"]).max() < 1e-4
    one = model.sample_actions(**inp, noise=noise, num_steps=1)
    assert np.abs(one.numpy() - ref["actions_1step"]).max() < 1e-4
    with torch.no_grad():
        loss = model(**inp, actions=torch.from_numpy(ref["loss_actions"]), noise=torch.from_numpy(ref["loss_noise"]),
                     time=torch.from_numpy(ref["loss_time"]))
    assert loss.shape == (2, 50, 32)
    assert np.abs(loss.mean(-1).numpy() - ref["loss"]).max() < 1e-4
    # Batch independence: each sample alone gives the same result (masks/positions are per row).
    solo = model.sample_actions(**{k: ([x[1:] for x in v] if isinstance(v, list) else v[1:]) for k, v in inp.items()},
                                noise=noise[1:], num_steps=10)
    assert np.abs(solo.numpy() - ref["actions"][1:]).max() < 1e-4


def test_parity_bfloat16(converted_tiny, pi0_reference):
    ref, inp = pi0_reference, model_inputs(pi0_reference)
    noise = torch.from_numpy(ref["noise"])
    pol = PI0Policy.from_pretrained(converted_tiny, dtype="bfloat16")
    assert pol.model.paligemma_with_expert.experts[1].layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert pol.model.action_in_proj.weight.dtype == torch.float32  # openpi's heads compute in float32
    assert pol.model.paligemma_with_expert.experts[0].norm.weight.dtype == torch.float32
    patch = pol.model.paligemma_with_expert.paligemma.vision_tower.vision_model.embeddings.patch_embedding
    assert patch.weight.dtype == torch.float32
    actions = pol.model.sample_actions(**inp, noise=noise, num_steps=10).numpy()
    err = np.abs(actions - ref["actions"]).max()
    # bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); through 4+4 layers and 10 Euler steps we
    # measured 3.4e-2 max abs (0.7% of max |action| = 4.7). Allow 2% of the action range.
    assert err < 0.02 * np.abs(ref["actions"]).max(), err
    assert err > 1e-4  # it really ran in bf16


def test_converter_cli_errors(tmp_path):
    script = REPO / "convert_pi0_to_hf_lerobot.py"
    r = subprocess.run([sys.executable, str(script), "--checkpoint_dir", str(tmp_path / "nope"),
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode != 0 and "does not exist" in r.stderr
    params = tmp_path / "ckpt" / "params"
    params.mkdir(parents=True)
    r = subprocess.run([sys.executable, str(script), "--checkpoint_dir", str(params),
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode != 0 and "norm_stats.json" in r.stderr and "--norm_stats" in r.stderr


def test_experts_of_different_widths_share_attention():
    """Like the real model (Gemma 2B width 2048 + 300M expert width 1024): joint attention needs only equal heads."""
    from pi0.models.config import GemmaConfig

    cfg = Pi0Config.tiny(paligemma=GemmaConfig(96, 2, 128, 4, 1, 16), action_expert=GemmaConfig(48, 2, 64, 4, 1, 16),
                         action_horizon=8, action_dim=6)
    torch.manual_seed(0)
    model = PI0Model(cfg).eval()
    b = 2
    imgs = [torch.rand(b, 3, 224, 224) * 2 - 1 for _ in range(3)]
    masks = [torch.tensor([True, True]), torch.tensor([True, False]), torch.tensor([False, False])]
    tokens = torch.randint(0, cfg.vocab_size, (b, 48))
    tmask = torch.arange(48)[None].expand(b, -1) < torch.tensor([[5], [9]])
    state, noise = torch.randn(b, 6), torch.randn(b, 8, 6)
    cached = model.sample_actions(imgs, masks, tokens, tmask, state, noise, num_steps=5)
    naive = model.sample_actions_uncached(imgs, masks, tokens, tmask, state, noise, num_steps=5)
    assert cached.shape == (2, 8, 6)
    torch.testing.assert_close(cached, naive, atol=1e-5, rtol=1e-5)
    loss = model(imgs, masks, tokens, tmask, state, torch.randn(b, 8, 6))
    assert loss.shape == (2, 8, 6) and torch.isfinite(loss).all()
    # A camera masked for a sample cannot influence that sample (its keys are masked, positions skip it).
    imgs2 = [imgs[0], -imgs[1], imgs[2] * 0]  # camera 1 changes for both samples; sample 1 has it masked
    again = model.sample_actions(imgs2, masks, tokens, tmask, state, noise, num_steps=5)
    torch.testing.assert_close(again[1], cached[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(again[0], cached[0], atol=1e-3)  # ...but it does influence the sample that sees it


def test_flatten_tree_strips_value_and_keeps_bf16():
    import ml_dtypes

    from pi0.conversion.pi0 import flatten_tree

    bf = np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)
    flat = flatten_tree({"PaliGemma": {"llm": {"w": {"value": bf}}}, "state_proj": {"bias": np.ones(2)}})
    assert sorted(flat) == ["PaliGemma/llm/w", "state_proj/bias"]
    # bf16 leaves (openpi may store them) go through the key map and convert to float32 losslessly
    out = dict(key_rules(CFG)["state_proj/kernel"](np.array([[1.5, -2.25]], dtype=ml_dtypes.bfloat16)))
    np.testing.assert_array_equal(np.array(out["state_proj.weight"], dtype=np.float32), [[1.5], [-2.25]])
    assert flat["PaliGemma/llm/w"].dtype == bf.dtype


def test_streamed_file_equals_in_memory_key_map(converted_tiny, flat, tmp_path):
    """The streaming converter writes exactly convert_params' tensors (float32), and their bf16 cast."""
    from safetensors.torch import load_file

    from pi0.conversion.pi0 import convert_checkpoint
    from pi0.modeling_pi0 import param_storage_dtype

    ref = convert_params(flat, infer_config(flat))
    got = load_file(str(converted_tiny / "model.safetensors"))
    assert sorted(got) == sorted(f"model.{k}" for k in ref)
    for k, v in ref.items():
        assert got[f"model.{k}"].dtype == torch.float32 and torch.equal(got[f"model.{k}"], torch.from_numpy(v)), k
    out = convert_checkpoint(PI0_TINY / "checkpoint" / "params", tmp_path / "bf16", dtype="bfloat16",
                             tokenizer=converted_tiny / "tokenizer.model")
    got = load_file(str(out / "model.safetensors"))
    for k, v in ref.items():
        want = torch.from_numpy(v).to(param_storage_dtype(k, "bfloat16"))
        assert got[f"model.{k}"].dtype == want.dtype and torch.equal(got[f"model.{k}"], want), k


def test_full_size_plan_from_shapes_only():
    """openpi's full-size tree (shared shapes file): config inferred and every key/shape checked, no weights."""
    import json

    from conftest import GOLDEN
    from pi0.conversion.pi0 import plan_conversion
    from pi0.conversion.zero_checkpoint import openpi_param_shapes

    shapes = {k: tuple(v) for k, v in json.loads((GOLDEN / "openpi_pi0_full_shapes.json").read_text())["shapes"].items()}
    view = {k: np.broadcast_to(np.zeros((), np.float32), s) for k, s in shapes.items()}  # zero-stride: no memory
    cfg = infer_config(view)
    assert (cfg.paligemma.variant, cfg.action_expert.variant, cfg.vision.variant) == ("gemma_2b", "gemma_300m",
                                                                                      "So400m/14")
    assert cfg == Pi0Config() and openpi_param_shapes(cfg) == shapes
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in PI0Model(cfg).state_dict().items()}
    plan = plan_conversion(view, cfg, expected)
    assert sum(len(v) for v in plan.values()) == len(expected)
    assert plan["PaliGemma/llm/layers/mlp/gating_einsum"][:2] == [
        ("paligemma_with_expert.paligemma.language_model.model.layers.0.mlp.gate_proj.weight", (16384, 2048)),
        ("paligemma_with_expert.paligemma.language_model.model.layers.0.mlp.up_proj.weight", (16384, 2048))]


@pytest.fixture(scope="module")
def zero_tiny_shapes():
    from pi0.conversion.zero_checkpoint import openpi_param_shapes

    return openpi_param_shapes(CFG)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.update({"PaliGemma/llm/bogus/w": (3,)}), "unknown openpi parameter.*PaliGemma/llm/bogus/w"),
    (lambda s: s.pop("action_out_proj/bias"), "model keys never set.*action_out_proj.bias"),
    (lambda s: s.update({"state_proj/bias": (63,)}), "shape mismatch for state_proj.bias"),
])
def test_streaming_converter_strictness_before_writing(tmp_path, zero_tiny_shapes, edit, match):
    from pi0.conversion.pi0 import convert_checkpoint
    from pi0.conversion.zero_checkpoint import write_zero_checkpoint

    shapes = dict(zero_tiny_shapes)
    edit(shapes)
    params = write_zero_checkpoint(shapes, tmp_path / "ckpt", dtype="float32")
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(params, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_unknown_asset_id_needs_delta_action_dims(tmp_path, zero_tiny_shapes):
    from pi0.conversion.pi0 import convert_checkpoint
    from pi0.conversion.zero_checkpoint import write_zero_checkpoint

    params = write_zero_checkpoint(zero_tiny_shapes, tmp_path / "ckpt", asset_id="trossen")
    with pytest.raises(ValueError, match="asset id 'trossen'") as e:
        convert_checkpoint(params, tmp_path / "out")
    for fact in ("--delta_action_dims N", "pi0_libero", "-> 6", "pi0_droid", "-> 0", "pi0_aloha",
                 "make_bool_mask(6, -1, 6, -1)"):
        assert fact in str(e.value), fact
    assert not (tmp_path / "out").exists()
    out = convert_checkpoint(params, tmp_path / "out", delta_action_dims=0, dtype="bfloat16")
    assert PI0Policy.from_pretrained(out).config.delta_action_dims == 0
