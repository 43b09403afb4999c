"""pi0-FAST: parity with openpi's JAX Pi0FAST (loss + greedy tokens), strict conversion, decoding conventions,
loss masking, prompt format, save/load and policy dispatch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import GOLDEN, PI0_TINY, REPO
from pi0.conversion.pi0fast import convert_fast_params, infer_fast_config, is_pi0fast_tree
from pi0.modeling_pi0fast import PI0FASTModel, Pi0FASTConfig
from pi0.policies import load_policy, model_type_of
from pi0.policies.presets import tiny_fast_policy
from pi0.policies.pi0fast import PI0FASTPolicy, discretize_state
from pi0.policies.presets import synthetic_observation

FAST_TINY = GOLDEN / "openpi_pi0fast_tiny"
CAMS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def _need(path):
    if not path.exists():
        pytest.skip(f"fixture {path} not available")
    return path


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(_need(FAST_TINY / "reference.npz")))


FAST_POLICY = GOLDEN / "openpi_pi0fast_libero_policy_tiny"  # its tokenizer.model covers the 1024-id vocab


def _convert_cmd(out, *extra):
    return [sys.executable, str(REPO / "convert_pi0_to_hf_lerobot.py"), "--checkpoint_dir",
            str(_need(FAST_TINY / "checkpoint" / "params")), "--output_path", str(out),
            "--norm_stats", str(_need(PI0_TINY / "checkpoint/assets/physical-intelligence/libero/norm_stats.json")),
            *extra]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The fixture converted through the same CLI as pi0 (pi0-FAST detected from the tree), with a FAST tokenizer
    fitted here and passed explicitly (the model-level parity does not depend on which one)."""
    from pi0.policies.fast_tokenizer import FASTTokenizer, synthetic_chunks

    root = tmp_path_factory.mktemp("fast")
    FASTTokenizer.fit(list(synthetic_chunks(256, 10, 7)), vocab_size=480).save_pretrained(root / "fast_tok")
    out = root / "policy"
    r = subprocess.run(_convert_cmd(out, "--action_horizon", "10", "--max_token_len", "64", "--fast_tokenizer",
                                    str(root / "fast_tok"), "--tokenizer", str(_need(FAST_POLICY / "tokenizer.model"))),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("extra, message", [
    ((), "missing --fast_tokenizer: a pi0-FAST checkpoint decodes actions with the FAST tokenizer"),
    (("--fast_tokenizer", "/nonexistent/fast"), "is not a FAST tokenizer directory"),
    (("--fast_tokenizer", str(FAST_POLICY / "fast_tokenizer")), "missing --tokenizer: a pi0-FAST checkpoint needs"),
    (("--fast_tokenizer", str(FAST_POLICY / "fast_tokenizer"), "--openpi_config", "pi0_fast_libero", "--tokenizer",
      str(GOLDEN / "openpi_libero_policy_tiny" / "tokenizer.model")),
     "--tokenizer has 400 pieces but the checkpoint's vocabulary has 1024"),
    (("--fast_tokenizer", str(GOLDEN / "openpi_pi0_tiny"), "--tokenizer", str(FAST_POLICY / "tokenizer.model")),
     "is not a FAST tokenizer directory (lacks ['processor_config.json', 'tokenizer.json', 'tokenizer_config.json'])"),
    (("--openpi_config", "pi05_libero"), "is a pi05 config but the checkpoint holds a pi0fast parameter tree"),
    (("--fast_tokenizer", str(FAST_POLICY / "fast_tokenizer"), "--tokenizer", str(FAST_POLICY / "tokenizer.model")),
     "does not record its action_horizon: pass --openpi_config NAME (one of pi0_fast_libero, pi0_fast_droid)"),
    (("--fast_tokenizer", str(FAST_POLICY / "fast_tokenizer"), "--tokenizer", str(FAST_POLICY / "tokenizer.model"),
      "--openpi_config", "pi0_libero"), "is a pi0 config but the checkpoint holds a pi0fast parameter tree"),
    (("--openpi_config", "pi0_fast_aloha"), "unknown --openpi_config 'pi0_fast_aloha'; known openpi configs"),
])
def test_conversion_refuses_what_it_cannot_know(tmp_path, extra, message):
    """Each missing input stops the converter with one line before any array is read or anything is written."""
    r = subprocess.run(_convert_cmd(tmp_path / "out", *extra), capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def _inputs(ref, prefix=""):
    return dict(images=[torch.from_numpy(ref[f"image/{k}"]).permute(0, 3, 1, 2) for k in CAMS],
                img_masks=[torch.from_numpy(ref[f"image_mask/{k}"]) for k in CAMS],
                tokens=torch.from_numpy(ref[f"{prefix}tokenized_prompt"]).long(),
                token_mask=torch.from_numpy(ref[f"{prefix}tokenized_prompt_mask"]))


@pytest.mark.slow
def test_parity_loss_and_greedy_tokens(converted, ref):
    policy = PI0FASTPolicy.from_pretrained(converted)
    assert model_type_of(converted) == "pi0fast" and isinstance(load_policy(converted), PI0FASTPolicy)
    model = policy.model
    with torch.no_grad():
        loss = model.compute_loss(**_inputs(ref), token_ar_mask=torch.from_numpy(ref["token_ar_mask"]),
                                  token_loss_mask=torch.from_numpy(ref["token_loss_mask"]))
    err = np.abs(loss.numpy() - ref["loss"]).max()
    print(f"pi0-FAST loss max abs error vs openpi: {err:.2e}")
    assert err <= 1e-4
    steps = int(ref["max_decoding_steps"])
    out = model.sample_tokens(**_inputs(ref, "inference_"), max_decoding_steps=steps)
    assert out.shape == (len(ref["loss"]), steps)
    np.testing.assert_array_equal(out.numpy(), ref["output_tokens"])
    # the no-cache baseline decodes the same tokens (4 steps: it is slow by design)
    out2 = model.sample_tokens(**_inputs(ref, "inference_"), max_decoding_steps=4, use_kv_cache=False)
    np.testing.assert_array_equal(out2.numpy(), ref["output_tokens"][:, :4])


def test_conversion_strictness(ref):
    from pi0.conversion.pi0 import read_orbax_params

    flat = read_orbax_params(_need(FAST_TINY / "checkpoint" / "params"))
    assert is_pi0fast_tree(flat) and not is_pi0fast_tree(list(flat) + ["PaliGemma/llm/final_norm_1/scale"])
    cfg = infer_fast_config(flat)
    assert (cfg.paligemma.width, cfg.paligemma.depth, cfg.vision.variant, cfg.vocab_size) == (64, 2, "mu/14", 1024)
    with torch.device("meta"):
        model = PI0FASTModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(convert_fast_params(flat, expected)) == set(expected)
    with pytest.raises(ValueError, match="unknown openpi parameter.*PaliGemma/llm/extra"):
        convert_fast_params({**flat, "PaliGemma/llm/extra": np.zeros(1)}, expected)
    missing = {k: v for k, v in flat.items() if k != "PaliGemma/img/head/bias"}
    with pytest.raises(ValueError, match="never set.*multi_modal_projector.linear.bias"):
        convert_fast_params(missing, expected)
    bad = {**flat, "PaliGemma/llm/final_norm/scale": np.zeros(65, np.float32)}
    with pytest.raises(ValueError, match="shape mismatch for paligemma.language_model.model.norm.weight"):
        convert_fast_params(bad, expected)


def test_q_einsum_and_kv_map_by_hand():
    from pi0.conversion.pi0fast import _rules

    q = np.arange(1 * 2 * 3 * 4, dtype=np.float32).reshape(1, 2, 3, 4)  # (L, N, D, H)
    (name, w), = list(_rules()["PaliGemma/llm/layers/attn/q_einsum/w"](q))
    assert name.endswith("layers.0.self_attn.q_proj.weight") and w.shape == (8, 3)
    # torch row n*H + h, column d == jax w[n, d, h]
    assert w[1 * 4 + 2, 1] == q[0, 1, 1, 2]


def test_right_align_by_hand():
    x = torch.arange(5.0)[None, :, None].repeat(2, 1, 1)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    attn = mask[:, None, :] & mask[:, :, None]
    x2, m2, a2 = PI0FASTModel.right_align(x, mask, attn)
    # sample 0: last valid index 3 -> roll by -4: [4, 0, 1, 2, 3]; sample 1 unchanged (roll by -5)
    assert x2[0, :, 0].tolist() == [4, 0, 1, 2, 3] and x2[1, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert m2[0].tolist() == [False, True, True, False, True]
    assert torch.equal(a2[0], m2[0][None, :] & m2[0][:, None])


def _tiny_model(seed=0):
    cfg = Pi0FASTConfig.tiny(vision=dataclasses.replace(Pi0FASTConfig.tiny().vision, image_size=28))
    torch.manual_seed(seed)
    m = PI0FASTModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.eval()


def _tiny_batch(b=2, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = [torch.rand(b, 3, 28, 28, generator=g) * 2 - 1 for _ in range(3)]
    masks = [torch.ones(b, dtype=torch.bool), torch.tensor([True, False])[:b], torch.zeros(b, dtype=torch.bool)]
    tokens = torch.randint(4, 1000, (b, length), generator=g)
    tmask = torch.ones(b, length, dtype=torch.bool)
    tmask[1, -3:] = False
    ar = torch.zeros(b, length, dtype=torch.long)
    ar[:, 6:] = 1
    loss = (ar == 1) & tmask
    return images, masks, tokens, tmask, ar, loss


def test_loss_is_masked_cross_entropy_on_postfix():
    m = _tiny_model()
    images, masks, tokens, tmask, ar, loss_mask = _tiny_batch()
    loss = m.compute_loss(images, masks, tokens, tmask, ar, loss_mask)
    # by hand: log-softmax of the tied-embedding logits at every position, mean over the masked targets
    emb, mask, arr = m.embed_inputs(images, masks, tokens, tmask, ar)
    from pi0.models.attention import make_attn_mask
    t = emb.shape[1] - 1
    pre, _ = m.transformer(emb[:, :-1], make_attn_mask(mask, arr)[:, :-1, :-1], torch.arange(t)[None].repeat(2, 1))
    logits = pre[:, -(tokens.shape[1] - 1):] @ m.lm.embed_tokens.weight.T
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    lm = loss_mask[:, 1:].float()
    torch.testing.assert_close(loss, (ce * lm).sum(1) / lm.sum(1))
    # tokens that are neither targets nor seen by a target do not change the loss: the padded tail
    t2 = tokens.clone()
    t2[1, -3:] = 7
    torch.testing.assert_close(m.compute_loss(images, masks, t2, tmask, ar, loss_mask), loss)
    # a prefix-only loss mask (no postfix) gives 0, not NaN
    zero = m.compute_loss(images, masks, tokens, tmask, ar, torch.zeros_like(loss_mask))
    assert torch.equal(zero, torch.zeros(2))
    # changing a postfix target changes the loss of that sample only
    t3 = tokens.clone()
    t3[0, 8] = 5
    l3 = m.compute_loss(images, masks, t3, tmask, ar, loss_mask)
    assert l3[0] != loss[0] and l3[1] == loss[1]


def test_early_stop_and_unused_slots_are_zero():
    m = _tiny_model()
    images, masks, tokens, tmask, _, _ = _tiny_batch()
    with torch.no_grad():  # make EOS (id 1) a likely argmax: a large embedding row through the tied logits
        m.lm.embed_tokens.weight[1] = m.lm.embed_tokens.weight[1] * 0 + 50.0
        m.lm.norm.weight.fill_(0.0)
    out = m.sample_tokens(images, masks, tokens, tmask, max_decoding_steps=6)
    first = [row.index(1) for row in out.tolist()]  # every sample emits EOS within the budget here
    stop = max(first)  # decoding stops at the step where the LAST sample emitted EOS ...
    assert stop < 5 and (out[:, stop + 1:] == 0).all()  # ... and the unused slots stay 0
    for i, f in enumerate(first):  # after its own EOS a sample's slots are 0, as openpi serving it alone gives
        assert (out[i, f + 1:] == 0).all()
    # batch invariance: each sample decoded alone gives its row of the batched output
    for i in range(out.shape[0]):
        alone = m.sample_tokens([im[i:i + 1] for im in images], [mk[i:i + 1] for mk in masks], tokens[i:i + 1],
                                tmask[i:i + 1], max_decoding_steps=6)
        assert torch.equal(alone[0], out[i])
    # stopping once every sample is done changes nothing: the full budget gives the same tokens
    assert torch.equal(m.sample_tokens(images, masks, tokens, tmask, max_decoding_steps=6, early_stop=False), out)


def test_cache_and_temperature_sampling():
    m = _tiny_model(seed=1)
    images, _, tokens, tmask, _, _ = _tiny_batch(seed=1)
    # every camera valid: with a masked camera, openpi's range mask lets decoding see the masked camera's
    # tokens, whose values depend on the (zero) cache padding, which the no-cache baseline does not reproduce
    masks = [torch.ones(2, dtype=torch.bool)] * 3
    a = m.sample_tokens(images, masks, tokens, tmask, max_decoding_steps=5)
    b = m.sample_tokens(images, masks, tokens, tmask, max_decoding_steps=5, use_kv_cache=False)
    assert torch.equal(a, b)
    s1 = m.sample_tokens(images, masks, tokens, tmask, 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    s2 = m.sample_tokens(images, masks, tokens, tmask, 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2) and s1.shape == (2, 5)


def test_prompt_format_and_extract_actions():
    policy = tiny_fast_policy()
    pt = policy.prompt
    assert discretize_state(np.array([-1.0, 0.0, 0.999, -2.0])).tolist() == [0, 128, 255, -1]
    acts = np.linspace(-0.5, 0.5, 70).reshape(10, 7)
    toks, mask, ar, loss = pt.tokenize("Pick_up  ", np.zeros(8), acts)
    n = sum(mask)
    prefix = pt.sp.encode(f"Task: pick up, State: {' '.join(['128'] * 8)};\n", add_bos=True)
    assert toks[: len(prefix)] == prefix and sum(1 - a for a in ar[:n]) == len(prefix)
    post = toks[len(prefix):n]
    assert post[: len(pt.action_prefix)] == pt.action_prefix and post[-1] == 1
    assert post[-1 - len(pt.bar):-1] == pt.bar and all(loss[len(prefix):n]) and not any(loss[:len(prefix)])
    fast_ids = pt.fast.encode(acts[None])[0]
    assert post[len(pt.action_prefix):-1 - len(pt.bar)] == (policy.config.model.vocab_size - 1 - 128
                                                             - np.array(fast_ids)).tolist()
    # decoding the postfix gives the chunk back (up to quantisation); garbage is flagged, never raises
    chunks, ok, problems = pt.extract_actions([post + [0] * 3, [5, 6, 7, 0], [], [1] + post], 10, 7, "best_effort")
    assert ok.tolist() == [True, False, False, False] and chunks.shape == (4, 10, 7)
    assert np.abs(chunks[0] - acts).max() < 0.15 and problems[1]


def test_policy_api_save_load_and_loss(tmp_path):
    policy = tiny_fast_policy(max_decoding_steps=4)
    obs = synthetic_observation(policy, 2)
    out = policy.predict_action_chunk_with_info(obs)
    assert out["actions"].shape == (2, 10, 7) and out["output_tokens"].shape == (2, 4)
    assert not out["ok"].any()  # an untrained model does not emit a well-formed action sequence: flagged
    policy.reset()
    a0 = policy.select_action(obs)
    assert a0.shape == (2, 7) and len(policy._queue) == policy.config.n_action_steps - 1
    acts = torch.rand(2, 10, 7) * 0.4 - 0.2
    loss = policy.compute_loss(obs, acts)
    assert loss.shape == (2,) and torch.isfinite(loss).all()
    loss.sum().backward()
    assert policy.model.lm.embed_tokens.weight.grad is not None
    policy.save_pretrained(tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["model_type"] == "pi0fast" and (tmp_path / "p" / "fast_tokenizer" / "tokenizer.json").is_file()
    again = load_policy(tmp_path / "p")
    torch.testing.assert_close(again.compute_loss(obs, acts), loss.detach())
    with pytest.raises(ValueError, match="actions must be"):
        policy.compute_loss(obs, acts[:, :5])
    with pytest.raises(ValueError, match="unknown override"):
        PI0FASTPolicy.from_pretrained(tmp_path / "p", bogus=1)


def _arena_obs(n=2):
    from pi0.envs.arena import ArenaEnv

    env = ArenaEnv(task_id=4, resolution=64)
    obs, _ = env.reset()
    return [obs] * n, [env.prompt] * n


def test_rollout_adapter_takes_pi0fast():
    """The rollout engine's ChunkPolicy (stage 2's and the runner's) drives a PI0FASTPolicy."""
    from pi0.policies.libero import Pi0ChunkPolicy

    policy = tiny_fast_policy(max_decoding_steps=3)
    obs, prompts = _arena_obs()
    out = Pi0ChunkPolicy(policy, torch.Generator().manual_seed(0)).predict_chunks(obs, prompts)
    assert out.actions.shape == (2, 10, 7) and out.extras["output_tokens"].shape == (2, 3)
    assert out.extras["ok"].tolist() == [False, False]  # untrained: flagged, not raised
    again = Pi0ChunkPolicy(policy).predict_chunks(obs, prompts)
    np.testing.assert_allclose(again.actions, out.actions)  # greedy: the generator does not matter


@pytest.mark.slow
def test_stage1_pi0fast(tmp_path):
    r = subprocess.run([sys.executable, "1_e2e_inference.py", "--model", "pi0fast"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "action chunk (1, 10, 7)" in r.stdout and "decoded tokens" in r.stdout


@pytest.mark.slow
def test_sft_script_smoke(tmp_path):
    """The SFT script end to end on a minimal budget (2 demos, 2 steps, 1 eval episode each)."""
    r = subprocess.run([sys.executable, "scripts/sft_pi0fast_arena.py", "--demo_inits", "2", "--eval_inits", "1",
                        "--train_steps", "2", "--batch_size", "2", "--num_envs", "1", "--max_decoding_steps", "2",
                        "--replan_steps", "10", "--out_dir", str(tmp_path / "sft")], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "sft" / "results.json").read_text())
    assert res["trained"]["episodes"] == 1 and res["random"]["episodes"] == 1
    assert isinstance(load_policy(tmp_path / "sft" / "policy"), PI0FASTPolicy)
