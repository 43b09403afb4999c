"""FastSampler: same numbers as the eager PI0Model.sample_actions, with each FLOP saving checked on its own."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import model_inputs
from pi0.models.cuda_graphs import clone_outputs
from pi0.models.config import GemmaConfig, Pi0Config, SiglipConfig
from pi0.models.gemma import rms_normalize
from pi0.models.flow_sde import EVERY_STEP, sde_times
from pi0.models.fast_sampler import FastSampler, euler_times, fold_action_time_mlp, round_up, trim_prompt_padding
from pi0.models.roofline import weight_bytes_per_call
from pi0.modeling_pi0 import PI0Model, PI0Policy
from pi0.policies.presets import synthetic_observation, tiny_policy

ATOL = 1e-5  # the bound for float32 parity


def _random_model(attn: str = "eager", dtype: str = "float32", **overrides) -> PI0Model:
    """Tiny pi0 with 56-px images (16 tokens per camera) and a 10-step horizon to keep the tests cheap."""
    torch.manual_seed(0)
    overrides = {"vision": SiglipConfig.from_variant("mu/14", image_size=56), "action_horizon": 10, **overrides}
    model = PI0Model(Pi0Config.tiny(attn_implementation=attn, dtype=dtype, **overrides))
    with torch.no_grad():
        for p in model.parameters():  # perturb everything (zero-initialised biases / norm scales matter)
            p.copy_(torch.randn(p.shape) * (0.05 if p.ndim > 1 else 0.1))
    return model.apply_precision().eval()


def _inputs(cfg: Pi0Config, b: int = 2, lengths=(7, 13), seed: int = 0):
    """Two cameras for sample 0, one for sample 1, the third camera masked everywhere; ragged prompts."""
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    imgs = [torch.rand(b, 3, s, s, generator=g) * 2 - 1 for _ in range(3)]
    masks = [torch.ones(b, dtype=torch.bool), torch.arange(b) == 0, torch.zeros(b, dtype=torch.bool)]
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_token_len), generator=g)
    tmask = torch.arange(cfg.max_token_len)[None] < torch.tensor(lengths)[:, None]
    state = torch.randn(b, cfg.action_dim, generator=g)
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g)
    return imgs, masks, tokens, tmask, state, noise


@pytest.fixture(scope="module")
def model():
    return _random_model()


def test_trim_prompt_padding_hand_computed():
    tok = torch.arange(10).reshape(2, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    t, m = trim_prompt_padding(tok, mask)
    assert t.tolist() == [[0, 1, 2], [5, 6, 7]] and m.tolist() == [[True, True, False], [True, True, True]]
    holes = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)  # only trailing all-padding columns go
    assert trim_prompt_padding(torch.zeros(1, 4), holes)[1].tolist() == [[True, False, True]]
    assert trim_prompt_padding(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool))[0].shape == (2, 1)
    assert trim_prompt_padding(tok, mask, multiple=4)[1].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]  # 3 -> 4
    assert trim_prompt_padding(tok, mask, multiple=16)[0].shape == (2, 5)  # never beyond L


def test_euler_times_match_openpi_schedule():
    ts = euler_times(10)
    np.testing.assert_allclose(ts, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1], atol=1e-6)
    assert euler_times(1) == [1.0] and len(euler_times(3)) == 3
    assert round_up(529, 16) == 544 and round_up(544, 16) == 544


def test_fold_action_time_mlp_hand_computed():
    w_in, b_in = torch.tensor([[1.0], [2.0]]), torch.tensor([0.5, -1.0])
    w_mlp = torch.tensor([[1.0, 0.0, 3.0, 0.0], [0.0, 2.0, 0.0, 1.0]])
    b_mlp = torch.tensor([0.1, 0.2])
    w_x, w_t, bias = fold_action_time_mlp(w_in, b_in, w_mlp, b_mlp)
    assert w_x.tolist() == [[1.0], [4.0]] and w_t.tolist() == [[3.0, 0.0], [0.0, 1.0]]
    torch.testing.assert_close(bias, torch.tensor([0.6, -1.8]))
    x, e = torch.tensor([[2.0]]), torch.tensor([[1.0, -1.0]])  # mlp_in([W_in x + b_in, e]) by hand: [5.6, 5.2]
    torch.testing.assert_close(x @ w_x.T + e @ w_t.T + bias, torch.tensor([[5.6, 5.2]]))


@pytest.mark.parametrize("trim,fuse,batch_cams", [(True, True, True), (True, False, False), (False, True, False),
                                                  (False, False, True), (False, False, False)])
def test_each_saving_matches_eager(model, trim, fuse, batch_cams):
    inp = _inputs(model.cfg)
    ref = model.sample_actions(*inp, num_steps=10)
    fast = FastSampler(model, trim_prompt=trim, fuse_projections=fuse, batch_cameras=batch_cams)
    out = fast(*inp, num_steps=10)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # The savings really happened: 2 live cameras (the all-masked one skipped) + 13 or 48 tokens + the state token.
    [(_, cap, _, _)] = list(fast._buffers)  # key: (batch, capacity, device, dtype)
    assert cap == round_up(2 * model.cfg.vision.num_patches + (13 if trim else 48) + 1, 16)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sdpa_bf16_and_unequal_widths(attn):
    m = _random_model(attn, paligemma=GemmaConfig(96, 2, 128, 4, 1, 16), action_expert=GemmaConfig(48, 2, 64, 4, 1, 16),
                      action_horizon=8, action_dim=6)
    inp = _inputs(m.cfg)
    torch.testing.assert_close(FastSampler(m)(*inp, num_steps=4), m.sample_actions(*inp, num_steps=4),
                               atol=ATOL, rtol=0)
    bf = _random_model(attn, dtype="bfloat16")
    inp = _inputs(bf.cfg)
    ref = bf.sample_actions(*inp, num_steps=3)
    out = FastSampler(bf)(*inp, num_steps=3)
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()  # bf16: different rounding order, same scale


def test_static_buffers_reused_without_stale_keys(model):
    fast = FastSampler(model, cache_bucket=128)
    long_inp, short_inp = _inputs(model.cfg, lengths=(30, 40), seed=1), _inputs(model.cfg, lengths=(5, 3), seed=2)
    for inp in (long_inp, short_inp, long_inp):  # same bucket: the short call runs on the long call's leftovers
        torch.testing.assert_close(fast(*inp, num_steps=3), model.sample_actions(*inp, num_steps=3), atol=ATOL, rtol=0)
    assert len(fast._buffers) == 1
    one = _inputs(model.cfg, b=1, lengths=(9,))  # another batch size: its own buffers
    torch.testing.assert_close(fast(*one, num_steps=3), model.sample_actions(*one, num_steps=3), atol=ATOL, rtol=0)


@pytest.mark.parametrize("compile_prefix", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_step_matches_eager(compile_prefix):
    # backend="aot_eager" traces and runs the same graph as inductor minus C++ codegen: inductor on this CPU
    # takes ~1 min to compile even the tiny config (see the slow test below and bench/sampling.py --compile).
    small = GemmaConfig(32, 2, 64, 2, 1, 16)
    model = _random_model(paligemma=small, action_expert=small)
    fast = FastSampler(model, compile=True, backend="aot_eager", compile_prefix=compile_prefix)
    inp = _inputs(model.cfg)
    ref = model.sample_actions(*inp, num_steps=10)
    torch.testing.assert_close(fast(*inp, num_steps=10), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast(*inp, num_steps=10), ref, atol=ATOL, rtol=0)  # second call: no recompile drift
    # Flow-SDE on the same compiled step (its times differ from the ODE's in the last float32 bit)
    g = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    sde = fast.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=5, noise_level=0.5, generator=g())
    ref_sde = model.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=5, noise_level=0.5, generator=g())
    torch.testing.assert_close(sde["chain"], ref_sde["chain"], atol=ATOL, rtol=0)
    torch.testing.assert_close(sde["log_prob"], ref_sde["log_prob"], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_inductor_compiled_step_matches_eager():
    small = GemmaConfig(32, 2, 64, 2, 1, 16)
    model = _random_model(paligemma=small, action_expert=small)
    fast = FastSampler(model, compile=True, backend="inductor")
    inp = _inputs(model.cfg)
    torch.testing.assert_close(fast(*inp, num_steps=10), model.sample_actions(*inp, num_steps=10), atol=ATOL, rtol=0)


def test_weight_updates_are_picked_up(model):
    m = copy.deepcopy(model)
    fast = FastSampler(m)
    inp = _inputs(m.cfg)
    before = fast(*inp, num_steps=3)
    with torch.no_grad():  # an optimizer step updates parameters in place
        m.action_in_proj.weight.mul_(1.5)
        m.action_time_mlp_in.bias.add_(0.3)
    after = fast(*inp, num_steps=3)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, m.sample_actions(*inp, num_steps=3), atol=ATOL, rtol=0)


def test_cuda_graph_guard_on_cpu(model):
    inp = _inputs(model.cfg)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA model"):
        FastSampler(model, cuda_graph=True)(*inp, num_steps=2)
    auto = FastSampler(model)  # cuda_graph=None: skipped on CPU
    auto(*inp, num_steps=2)
    assert len(auto.graphs) == 0 and auto.graph_error is None
    with pytest.raises(ValueError, match="noise must be"):
        auto(*inp[:5], noise=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="backend must be one of"):
        FastSampler(model, backend="tensorrt")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("compile,scope", [(False, "call"), (True, "call"), (False, "loop"), (True, "loop")])
def test_cuda_graph_matches_eager(compile, scope):
    m = _random_model("sdpa").cuda()
    inp = [[t.cuda() for t in x] if isinstance(x, list) else x.cuda() for x in _inputs(m.cfg)]
    ref = m.sample_actions(*inp, num_steps=10)
    fast = FastSampler(m, compile=compile, compile_prefix=compile, cuda_graph=True, graph_scope=scope)
    for seed in range(3):  # capture, then replays with fresh copy-in
        noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)).cuda()
        out = fast(*inp[:5], noise=noise, num_steps=10)
        assert fast.graph_error is None and len(fast.graphs) == 1
        assert (next(iter(fast.graphs))[0] == "call") == (scope == "call")
        torch.testing.assert_close(out, m.sample_actions(*inp[:5], noise=noise, num_steps=10), atol=1e-4, rtol=0)
    images = [img.flip(-1) for img in inp[0]]  # new inputs of the same plan: the same graph, fresh copy-in
    torch.testing.assert_close(fast(images, *inp[1:5], noise=noise, num_steps=10),
                               m.sample_actions(images, *inp[1:5], noise=noise, num_steps=10), atol=1e-4, rtol=0)
    with torch.no_grad():  # an RL update in place: the replayed graph reads the refreshed fused weights
        m.action_time_mlp_in.bias.add_(0.3)
        m.paligemma_with_expert.paligemma.vision_tower.vision_model.post_layernorm.weight.mul_(1.5)
    out = fast(*inp[:5], noise=noise, num_steps=10)
    assert len(fast.graphs) == 1
    torch.testing.assert_close(out, m.sample_actions(*inp[:5], noise=noise, num_steps=10), atol=1e-4, rtol=0)
    other = [inp[1][0], inp[1][0], inp[1][0]]  # all three cameras live: another plan, another graph
    torch.testing.assert_close(fast(inp[0], other, *inp[2:5], noise=noise, num_steps=10),
                               m.sample_actions(inp[0], other, *inp[2:5], noise=noise, num_steps=10), atol=1e-4, rtol=0)
    assert len(fast.graphs) == 2 and fast.graph_error is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("pi05", [False, True])
def test_cuda_graph_flow_sde_matches_eager(pi05):
    m = _random_model("sdpa", pi05=pi05).cuda()
    inp = [[t.cuda() for t in x] if isinstance(x, list) else x.cuda() for x in _inputs(m.cfg)]
    fast = FastSampler(m, cuda_graph=True)
    for seed in range(3):  # one graph per stochastic step, replayed with fresh noise and draws
        g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
        out = fast.sample_actions_sde(*inp, num_steps=5, noise_level=0.5, sde_step=seed % 2, generator=g())
        ref = m.sample_actions_sde(*inp, num_steps=5, noise_level=0.5, sde_step=seed % 2, generator=g())
        assert fast.graph_error is None
        torch.testing.assert_close(out["chain"], ref["chain"], atol=1e-4, rtol=0)
        torch.testing.assert_close(out["log_prob"], ref["log_prob"], atol=1e-4, rtol=0)
    assert len(fast.graphs) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
@pytest.mark.parametrize("pi05", [False, True])
def test_cuda_graph_flow_sde_returns_the_prefix_cache(pi05):
    """The whole-call graph's ``return_prefix`` (what ``algo.reuse_prefix`` trains on): per sample, the valid keys and
    values equal eager ``encode_prefix``'s, on every replay (fresh copy-out), and the chain is unchanged."""
    from pi0.models.paligemma_with_expert import pack_kv_cache

    m = _random_model("sdpa", pi05=pi05).cuda()
    fast = FastSampler(m, cuda_graph=True)
    for seed in range(2):
        imgs, masks, tokens, tmask, state, noise = [[t.cuda() for t in x] if isinstance(x, list) else x.cuda()
                                                     for x in _inputs(m.cfg, seed=seed)]
        g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
        out = fast.sample_actions_sde(imgs, masks, tokens, tmask, state, noise, num_steps=5, noise_level=0.5,
                                      sde_step=0, generator=g(), return_prefix=True)
        ref = m.sample_actions_sde(imgs, masks, tokens, tmask, state, noise, num_steps=5, noise_level=0.5,
                                   sde_step=0, generator=g())
        assert fast.graph_error is None
        torch.testing.assert_close(out["chain"], ref["chain"], atol=1e-4, rtol=0)
        kv, pad = out["prefix"]
        cache, ref_pad = m.encode_prefix(imgs, masks, tokens, tmask)
        ref_kv = pack_kv_cache(cache)
        for j in range(kv.shape[0]):
            assert int(pad[j].sum()) == int(ref_pad[j].sum())
            torch.testing.assert_close(kv[j][:, pad[j]], ref_kv[j][:, ref_pad[j]], atol=1e-4, rtol=1e-4)


def test_policy_option_and_deepcopy():
    policy = tiny_policy(seed=3, num_steps=3)
    obs = synthetic_observation(policy, batch_size=2)
    noise = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(0))
    eager = policy.predict_action_chunk(obs, noise=noise)
    sampler = policy.enable_fast_sampling()
    assert isinstance(sampler, FastSampler) and policy.model.fast_sampler is sampler
    torch.testing.assert_close(policy.predict_action_chunk(obs, noise=noise), eager, atol=ATOL, rtol=0)
    twin = copy.deepcopy(policy)  # e.g. RL's frozen old policy: its sampler must drive the copy, not the original
    assert twin.model.fast_sampler is not sampler and twin.model.fast_sampler.model is twin.model
    torch.testing.assert_close(twin.predict_action_chunk(obs, noise=noise), eager, atol=ATOL, rtol=0)
    assert policy.enable_fast_sampling(False) is None
    torch.testing.assert_close(policy.predict_action_chunk(obs, noise=noise), eager, atol=0, rtol=0)


def test_fast_sampler_reproduces_openpi(converted_tiny, pi0_reference):
    model = PI0Policy.from_pretrained(converted_tiny).model
    inp = model_inputs(pi0_reference)
    noise = torch.from_numpy(pi0_reference["noise"])
    fast = FastSampler(model)(**inp, noise=noise, num_steps=int(pi0_reference["num_steps"]))
    torch.testing.assert_close(fast, model.sample_actions(**inp, noise=noise, num_steps=10), atol=ATOL, rtol=0)
    assert np.abs(fast.numpy() - pi0_reference["actions"]).max() < 1e-4


def test_weight_bytes_hand_computed(model):
    # Gemma "dummy" layer: q 64x128, k/v 64x16, o 128x64, MLP 3 x 64x128, two norms: 43,136 params; 4 layers
    # + final norm = 172,608 float32 params. The expert is read once with the prefix and once per step.
    parts = weight_bytes_per_call(model, num_steps=3, cameras=2)
    assert parts["expert"] == 172_608 * 4 * (3 + 1)
    assert parts["gemma_prefix"] == 172_608 * 4
    # SigLIP mu/14 at 56 px: patch conv 3*14*14*32+32, 16 position rows x 32, two LayerNorms, q/k/v/o 4 x (32*32+32),
    # MLP 32*128+128 + 128*32+32, post LayerNorm, projector 32*64+64; read once for all live cameras.
    assert parts["siglip"] == 4 * (18_848 + 16 * 32 + 128 + 4 * 1_056 + 8_352 + 64 + 2_112)
    assert parts["siglip"] == weight_bytes_per_call(model, num_steps=3, cameras=1)["siglip"]
    assert weight_bytes_per_call(model, num_steps=3, cameras=0)["siglip"] == 0
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


@pytest.fixture(scope="module")
def pi05_model():
    return _random_model(pi05=True, value_head=True)


@pytest.mark.parametrize("pi05,sde_step,kind", [(False, 2, "flow_sde"), (False, None, "flow_sde"),
                                                (True, 2, "flow_sde"), (True, None, "flow_sde"),
                                                (False, 0, "cps"), (True, None, "cps")])
def test_flow_sde_fast_matches_eager(model, pi05_model, pi05, sde_step, kind):
    """Flow-SDE (and CPS) through FastSampler: the same chunk, chain, step, log-density (and value) as eager for one
    seed, and the recorded log-density equal to step_log_prob's recomputation (PPO's ratio 1)."""
    m = copy.deepcopy(pi05_model if pi05 else model)
    if not pi05:
        m.enable_value_head()
        with torch.no_grad():  # a zero-initialised output layer would hide a wrong feature
            m.value_head.out.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    inp = _inputs(m.cfg)
    run = lambda: m.sample_actions_sde(*inp, num_steps=5, noise_level=0.7, sde_step=sde_step,  # noqa: E731
                                       generator=torch.Generator().manual_seed(11), sde_kind=kind)
    ref = run()
    fast = m.enable_fast_sampling()
    out = run()
    assert fast._buffers, "sample_actions_sde did not go through the FastSampler"
    assert out.keys() == ref.keys() == {"actions", "chain", "sde_step", "log_prob", "value"}
    assert out["sde_step"] == ref["sde_step"] == (sde_step if sde_step is not None else ref["sde_step"])
    assert out["sde_step"] < (4 if kind == "cps" else 5)  # cps never draws the last step (its std would be 0)
    assert out["chain"].shape == (2, 6, m.cfg.action_horizon, m.cfg.action_dim)
    for key in ("actions", "chain", "log_prob", "value"):
        torch.testing.assert_close(out[key], ref[key], atol=ATOL, rtol=0, msg=key)
    assert torch.equal(out["chain"][:, -1], out["actions"]) and out["value"].abs().max() > 1e-3
    # the stochastic step really drew noise: the chain leaves the deterministic path after step k
    k = out["sde_step"]
    det = m.sample_actions_sde(*inp, num_steps=5, noise_level=0.0, sde_step=k)
    assert (det["chain"][:, k + 1] - out["chain"][:, k + 1]).abs().max() > 1e-2
    again = m.step_log_prob(*inp[:5], chain=out["chain"], sde_step=k, num_steps=5, noise_level=0.7, sde_kind=kind)
    torch.testing.assert_close(again, out["log_prob"], atol=ATOL, rtol=0)
    other = m.step_log_prob(*inp[:5], chain=out["chain"], sde_step=k, num_steps=5, noise_level=0.7,
                            sde_kind="cps" if kind == "flow_sde" else "flow_sde")
    assert (other - out["log_prob"]).abs().max() > 1e-2  # the kind reaches the recomputation


def test_flow_sde_fast_without_value_head_and_weight_updates(model):
    m = copy.deepcopy(model)
    inp = _inputs(m.cfg)
    fast = FastSampler(m)
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    out = fast.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, generator=g())
    assert "value" not in out
    ref = m.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, generator=g())
    torch.testing.assert_close(out["chain"], ref["chain"], atol=ATOL, rtol=0)
    with torch.no_grad():  # an RL update between calls must be picked up by the fast path
        m.action_time_mlp_in.bias.add_(0.3)
        m.paligemma_with_expert.gemma_expert.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    out = fast.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, generator=g())
    ref2 = m.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, generator=g())
    assert (ref2["chain"] - ref["chain"]).abs().max() > 1e-3
    torch.testing.assert_close(out["chain"], ref2["chain"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["log_prob"], ref2["log_prob"], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="sde_step must be"):
        fast.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, sde_step=4)
    with pytest.raises(ValueError, match="sde_step must be in .0, 3. for cps"):  # the last step: std 0
        fast.sample_actions_sde(*inp[:5], noise=inp[5], num_steps=4, noise_level=0.5, sde_step=3, sde_kind="cps")


# ---------------------------------------------------------------- fused layers (issue 40 item 2)
def test_fold_norm_scale_and_rope_tables_by_hand():
    from pi0.models.attention import apply_rope
    from pi0.models.fused import fold_norm_scale, rope_tables
    from pi0.models.gemma import RMSNorm

    norm = RMSNorm(2)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, -0.5]))  # (1 + scale) = [2, 0.5]
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert fold_norm_scale(w, norm).tolist() == [[2.0, 1.0], [6.0, 2.0]]  # columns scaled
    x = torch.randn(3, 2)
    torch.testing.assert_close(F.linear(norm(x), w), F.linear(rms_normalize(x), fold_norm_scale(w, norm)))
    # RoPE tables: q rotated and scaled by head_dim**-0.5, k rotated, v untouched, all by x * cos + roll(x) * sin
    pos = torch.tensor([[0, 3, 7]])
    cos, sin = rope_tables(pos, num_heads=2, num_kv=1, head_dim=8)
    assert cos.shape == (1, 3, 4, 8)
    x = torch.randn(1, 3, 4, 8)
    out = x * cos + x.roll(4, -1) * sin
    torch.testing.assert_close(out[:, :, :2], apply_rope(x[:, :, :2], pos) * 8 ** -0.5, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, :, 2:3], apply_rope(x[:, :, 2:3], pos), atol=1e-6, rtol=0)
    assert torch.equal(out[:, :, 3:], x[:, :, 3:])


def test_adarms_modulations_in_one_gemm_equal_each_norm():
    from pi0.models.fused import adarms_modulations, adarms_stack

    m = _random_model(pi05=True)
    expert = m.paligemma_with_expert.experts[1]
    cond = torch.randn(1, 64)
    mods = adarms_modulations(adarms_stack(expert), cond, torch.float32, 64)
    norms = [n for lay in expert.layers for n in (lay.input_layernorm, lay.post_attention_layernorm)] + [expert.norm]
    assert len(mods) == len(norms) == 9
    x = torch.randn(2, 5, 64)
    for (scale1, shift, gate), norm in zip(mods, norms):
        ref, ref_gate = norm(x, cond)
        torch.testing.assert_close(rms_normalize(x) * scale1 + shift, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(gate, ref_gate, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pi05", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fused_layers_match_eager(model, pi05_model, pi05, attn):
    m = copy.deepcopy(pi05_model if pi05 else model)
    m.cfg = m.paligemma_with_expert.cfg = dataclasses.replace(m.cfg, attn_implementation=attn)
    inp = _inputs(m.cfg)
    ref = m.sample_actions(*inp, num_steps=10)
    fast = FastSampler(m)
    torch.testing.assert_close(fast(*inp, num_steps=10), ref, atol=ATOL, rtol=0)
    assert fast._fw is not None and fast._buffers and all(not b.k for b in fast._buffers.values())  # fused cache
    unfused = FastSampler(m, fuse_layers=False)
    torch.testing.assert_close(unfused(*inp, num_steps=10), ref, atol=ATOL, rtol=0)
    assert unfused._fw is None
    # ragged batch of one, other bucket
    one = _inputs(m.cfg, b=1, lengths=(30,), seed=3)
    torch.testing.assert_close(fast(*one, num_steps=3), m.sample_actions(*one, num_steps=3), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pi05", [False, True])
def test_fused_weights_follow_optimizer_steps_and_lora(model, pi05_model, pi05):
    """RL updates weights between calls: the folded / concatenated copies must follow (optimizer's in-place
    updates, a LoRA adapter's update merged in)."""
    from pi0.models.lora import apply_lora

    m = copy.deepcopy(pi05_model if pi05 else model)
    inp = _inputs(m.cfg)
    fast = FastSampler(m)
    before = fast(*inp, num_steps=3)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)  # foreach in-place updates of every parameter
    loss = m(*inp[:5], actions=torch.zeros_like(inp[5]), noise=inp[5], time=torch.full((2,), 0.5)).mean()
    loss.backward()
    opt.step()
    after = fast(*inp, num_steps=3)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, m.sample_actions(*inp, num_steps=3), atol=ATOL, rtol=0)
    apply_lora(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    lora = fast(*inp, num_steps=3)
    assert (lora - after).abs().max() > 1e-3
    torch.testing.assert_close(lora, m.sample_actions(*inp, num_steps=3), atol=ATOL, rtol=0)


def test_fused_sampler_reproduces_openpi_unfused_too(converted_tiny, pi0_reference):
    model = PI0Policy.from_pretrained(converted_tiny).model
    inp = model_inputs(pi0_reference)
    noise = torch.from_numpy(pi0_reference["noise"])
    for fuse in (True, False):
        out = FastSampler(model, fuse_layers=fuse)(**inp, noise=noise, num_steps=10)
        assert np.abs(out.numpy() - pi0_reference["actions"]).max() < 1e-4, fuse


# ---------------------------------------------------------------- masked cameras (issue 40 item 3)
@pytest.mark.parametrize("pi05", [False, True])
def test_all_masked_camera_is_skipped_and_changes_nothing(model, pi05_model, pi05):
    """A camera masked in every sample is not encoded and its tokens are not in the prefix, on the eager and the
    fast path; the result equals the one with its tokens present but masked (positions from the mask's cumsum)."""
    m = copy.deepcopy(pi05_model if pi05 else model)
    pwe = m.paligemma_with_expert
    inp = _inputs(m.cfg)  # camera 2 masked everywhere, camera 1 in sample 0 only
    encoded = []
    embed_image = pwe.embed_image
    pwe.embed_image = lambda img: encoded.append(img.shape[0]) or embed_image(img)

    def embed_all(images, img_masks, lang_tokens, lang_masks):  # every camera's tokens, masked ones included
        embs = [embed_image(img) for img in images]
        pads = [mk.bool()[:, None].expand(-1, e.shape[1]) for e, mk in zip(embs, img_masks)]
        emb = torch.cat(embs + [pwe.embed_language(lang_tokens)], 1)
        pad = torch.cat(pads + [lang_masks.bool()], 1)
        return emb, pad, torch.zeros(emb.shape[1], dtype=torch.bool)

    skipped = m.sample_actions(*inp, num_steps=4)
    assert encoded == [2, 2]  # eager: two SigLIP passes of the batch (cameras 0 and 1), none for camera 2
    _, pad = m.encode_prefix(*inp[:4])
    p = m.cfg.vision.num_patches
    assert pad.shape[1] == 2 * p + m.cfg.max_token_len
    encoded.clear()
    fast = FastSampler(m)(*inp, num_steps=4)
    assert encoded == [4]  # fast: one SigLIP pass of the two live cameras
    m.embed_prefix = embed_all
    present = m.sample_actions(*inp, num_steps=4)
    assert m.encode_prefix(*inp[:4])[1].shape[1] == 3 * p + m.cfg.max_token_len
    assert (present - skipped).abs().max() < ATOL and (fast - present).abs().max() < ATOL
    # the same inputs with camera 2 unmasked for one sample do change the chunk (the test can see a camera)
    masks = [inp[1][0], inp[1][1], torch.arange(2) == 1]
    assert (m.sample_actions(inp[0], masks, *inp[2:], num_steps=4) - present).abs().max() > 1e-3


# ---------------------------------------------------------------- the whole call as one graph (issue 40 item 1)
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::item"}


class _OpLog(TorchDispatchMode):
    """Records the name of every aten op dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_plan_reads_live_cameras_and_prompt_bucket_by_hand(model):
    _, masks, _, tmask, _, _ = _inputs(model.cfg)  # cameras: all, sample 0 only, none; prompts of 7 and 13
    fast = FastSampler(model)
    assert fast.plan(masks, tmask) == ((0, 1), 13)
    assert fast.plan(masks, tmask, multiple=16) == ((0, 1), 16)
    assert fast.plan([masks[2], masks[0]], tmask[:, :5], multiple=16) == ((1,), 5)  # never beyond L
    assert FastSampler(model, trim_prompt=False).plan(masks, tmask) == ((0, 1), model.cfg.max_token_len)
    with pytest.raises(ValueError, match="graph_scope must be one of"):
        FastSampler(model, graph_scope="prefix")


@pytest.mark.parametrize("pi05", [False, True])
def test_whole_call_closure_has_no_host_sync_and_matches_eager(model, pi05_model, pi05):
    """What a whole-call CUDA graph captures (SigLIP, prefix, cache set-up, Euler loop) dispatches no op that reads
    a device value on the host, and gives the eager chunk; the un-planned prefix does read (so this can fail)."""
    m = pi05_model if pi05 else model
    imgs, masks, tokens, tmask, state, noise = _inputs(m.cfg)
    fast = FastSampler(m)
    fast(imgs, masks, tokens, tmask, state, noise=noise, num_steps=4)  # builds the fused weights
    times = fast._time_inputs(euler_times(4), 2, state.device)
    key, run = fast.call_fn(imgs, masks, tokens, tmask, state, noise, ("ode", 4),
                            lambda buf, st, v: fast._loop(buf, times, -1.0 / 4))
    assert key == ("call", 2, ((0, 1), 16), "ode", 4)
    with torch.no_grad(), _OpLog() as log:
        out = run()
    assert not SYNC_OPS & set(log.ops), sorted(SYNC_OPS & set(log.ops))
    torch.testing.assert_close(out, m.sample_actions(imgs, masks, tokens, tmask, state, noise=noise, num_steps=4),
                               atol=ATOL, rtol=0)
    with torch.no_grad(), _OpLog() as unplanned:
        fast.encode(imgs, masks, tokens, tmask, state)
    assert SYNC_OPS & set(unplanned.ops)


@pytest.mark.parametrize("pi05", [False, True])
def test_whole_call_path_through_the_public_calls(model, pi05_model, pi05, monkeypatch):
    """sample_actions / sample_actions_sde on the whole-call path (the graph replay stood in by running the
    closure: CUDA graphs need a GPU, see the cuda tests) equal eager, fresh copy-in on every call; the SDE keeps
    the eager generator calls (same step, same draw) and the value head."""
    m = pi05_model if pi05 else model
    imgs, masks, tokens, tmask, state, noise = _inputs(m.cfg)
    fast = FastSampler(m)
    monkeypatch.setattr(fast, "_use_graph", lambda device: True)
    replayed: list[tuple] = []
    monkeypatch.setattr(fast, "_replay",  # the closure run where the graph would replay, its copy-out applied
                        lambda key, loop, copy_out=clone_outputs: (replayed.append(key), copy_out(loop()))[1])
    for seed in range(2):
        nz = torch.randn(noise.shape, generator=torch.Generator().manual_seed(seed))
        out = fast(imgs, masks, tokens, tmask, state, noise=nz, num_steps=4)
        ref = m.sample_actions(imgs, masks, tokens, tmask, state, noise=nz, num_steps=4)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        g = lambda: torch.Generator().manual_seed(20 + seed)  # noqa: E731
        sde = fast.sample_actions_sde(imgs, masks, tokens, tmask, state, nz, num_steps=4, noise_level=0.7,
                                      generator=g())
        eager = m.sample_actions_sde(imgs, masks, tokens, tmask, state, nz, num_steps=4, noise_level=0.7,
                                     generator=g())
        assert sde["sde_step"] == eager["sde_step"] and sde.keys() == eager.keys()
        for k in ("chain", "log_prob", "value") if pi05 else ("chain", "log_prob"):
            torch.testing.assert_close(sde[k], eager[k], atol=ATOL, rtol=0, msg=k)
        # the prefix cache comes out of the graph as views of the static buffers, packed by the copy-out
        with_prefix = fast.sample_actions_sde(imgs, masks, tokens, tmask, state, nz, num_steps=4, noise_level=0.7,
                                              generator=g(), return_prefix=True)
        torch.testing.assert_close(with_prefix["chain"], eager["chain"], atol=ATOL, rtol=0)
        kv, pad = with_prefix["prefix"]
        ref_kv, ref_pad = m.sample_actions_sde(imgs, masks, tokens, tmask, state, nz, num_steps=4, noise_level=0.7,
                                               generator=g(), return_prefix=True)["prefix"]
        assert kv.shape[:2] == (2, m.cfg.paligemma.depth) and kv.shape[2] == pad.shape[1]
        for j in range(2):
            assert int(pad[j].sum()) == int(ref_pad[j].sum())
            torch.testing.assert_close(kv[j][:, pad[j]], ref_kv[j][:, ref_pad[j]], atol=ATOL, rtol=0)
    assert [k[0] for k in replayed] == ["call"] * 6 and {k[3] for k in replayed} == {"ode", "sde"}


def test_every_step_chain_fast_matches_eager_and_sums_the_steps(model):
    """sde_step=EVERY_STEP: the fast sampler gives eager's chain and log-density for one seed; the log-density is the
    sum of each step's one-step log-density on the recorded chain; every step left the deterministic path;
    chain_log_prob recomputes it, and its gradient equals that of the sum of the N one-step recomputations (the
    prefix reached through the cache, as in the joint pass)."""
    m = copy.deepcopy(model)
    inp = _inputs(m.cfg)
    run = lambda: m.sample_actions_sde(*inp, num_steps=4, noise_level=0.5, sde_step=EVERY_STEP,  # noqa: E731
                                       generator=torch.Generator().manual_seed(5))
    ref = run()
    m.enable_fast_sampling()
    out = run()
    assert out["sde_step"] == ref["sde_step"] == EVERY_STEP
    for key in ("actions", "chain", "log_prob"):
        torch.testing.assert_close(out[key], ref[key], atol=ATOL, rtol=0, msg=key)
    m.enable_fast_sampling(False)
    chain = out["chain"]
    steps = [m.step_log_prob(*inp[:5], chain=chain, sde_step=k, num_steps=4, noise_level=0.5) for k in range(4)]
    torch.testing.assert_close(sum(steps), out["log_prob"], atol=1e-4, rtol=0)
    det = m.sample_actions_sde(*inp, num_steps=4, noise_level=0.0, sde_step=0)["chain"]
    euler = torch.stack([chain[:, k] - 0.25 * m.predict_velocity(*inp[:5], chain[:, k], torch.full((2,), t))
                         for k, t in enumerate(sde_times(4))], 1).detach()
    assert (euler - chain[:, 1:]).flatten(2).abs().amax(-1).min() > 1e-2  # each step drew noise
    assert (det[:, -1] - chain[:, -1]).abs().max() > 1e-2
    whole = m.chain_log_prob(*inp[:5], chain=chain, num_steps=4, noise_level=0.5)
    torch.testing.assert_close(whole, out["log_prob"], atol=1e-4, rtol=0)
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    g_whole = torch.autograd.grad(m.chain_log_prob(*inp[:5], chain=chain, num_steps=4, noise_level=0.5).sum(), params,
                                  allow_unused=True)
    g_steps = torch.autograd.grad(sum(m.step_log_prob(*inp[:5], chain=chain, sde_step=k, num_steps=4, noise_level=0.5)
                                      for k in range(4)).sum(), params, allow_unused=True)
    named = dict(zip([n for n, p in m.named_parameters() if p.requires_grad], zip(g_whole, g_steps)))
    vision = [n for n in named if "vision" in n or "siglip" in n]
    assert vision and any(named[n][0] is not None and named[n][0].abs().max() > 0 for n in vision)
    for n, (a, b) in named.items():  # None: unused by the cached path (the last layer's prefix queries), 0 in the joint
        if a is None or b is None:
            assert all(g is None or not g.any() for g in (a, b)), n
        else:
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=n)
    with pytest.raises(ValueError, match="mixes whole-chain"):
        m.step_log_prob(*inp[:5], chain=chain, sde_step=torch.tensor([EVERY_STEP, 0]), num_steps=4, noise_level=0.5)
