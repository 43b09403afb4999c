"""openpi's whole pi0_fast_libero policy path on raw LIBERO observations, against openpi's own outputs.

The fixture (``../shared/golden/openpi_pi0fast_libero_policy_tiny``) is converted by the real CLI with
``--openpi_config pi0_fast_libero`` and its own tokenizers. Greedy tokens of a random model are chaotic, so they
are compared exactly; a wrong camera mask or prompt layout changes hundreds of them.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import CAMERAS as CAMS
from conftest import GOLDEN, REPO, golden_env_obs, need_fixture
from pi0.policies.libero import Pi0ChunkPolicy, construct_libero_observation, predict_libero_action_chunk
from pi0.policies import load_policy
from pi0.policies.pi0fast import discretize_state

FIX = GOLDEN / "openpi_pi0fast_libero_policy_tiny"
CKPT = GOLDEN / "openpi_pi0fast_tiny" / "checkpoint" / "params"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(need_fixture(FIX / "reference.npz")))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fast_libero") / "policy"
    cmd = [sys.executable, str(REPO / "convert_pi0_to_hf_lerobot.py"), "--checkpoint_dir", str(need_fixture(CKPT)),
           "--output_path", str(out), "--openpi_config", "pi0_fast_libero", "--norm_stats",
           str(FIX / "norm_stats.json"), "--tokenizer", str(FIX / "tokenizer.model"),
           "--fast_tokenizer", str(FIX / "fast_tokenizer")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def policy(policy_dir):
    return load_policy(policy_dir)


def test_converted_config_is_openpis_pi0_fast_libero(policy):
    cfg = policy.config
    assert (cfg.model.action_horizon, cfg.model.max_token_len, cfg.model.action_dim) == (10, 180, 7)
    assert (cfg.normalization, cfg.delta_action_dims, cfg.action_decoding) == ("quantile", 6, "openpi")
    assert cfg.model.decode_position_offset == 1 and cfg.model.max_decoding_steps == 256


def test_model_inputs_match_openpi(policy, ref):
    n = ref["actions"].shape[0]
    observation, client = construct_libero_observation([golden_env_obs(ref, i) for i in range(n)], list(ref["prompt"]),
                                                       policy)
    np.testing.assert_array_equal(client["image"], ref["client/image"])
    np.testing.assert_array_equal(client["wrist_image"], ref["client/wrist_image"])
    inp = policy.prepare_inputs(observation)
    for img, mask, key in zip(inp["images"], inp["img_masks"], CAMS):
        np.testing.assert_array_equal(img.permute(0, 2, 3, 1).numpy(), ref[f"model_input/image/{key}"])
        np.testing.assert_array_equal(mask.numpy(), ref[f"model_input/image_mask/{key}"])
    assert inp["img_masks"][2].all()  # pi0-FAST: the zero right-wrist image is NOT masked (openpi LiberoInputs)
    from pi0.policies.normalize import normalize

    state_norm = normalize(inp["raw_state"], policy.norm_stats["state"], "quantile").numpy()
    np.testing.assert_array_equal(state_norm, ref["transformed/state_normalized"])  # bit-identical formula
    np.testing.assert_array_equal(discretize_state(state_norm), ref["transformed/state_discretized"])
    np.testing.assert_array_equal(inp["tokens"].numpy(), ref["model_input/tokenized_prompt"])
    np.testing.assert_array_equal(inp["token_mask"].numpy(), ref["model_input/tokenized_prompt_mask"])


@pytest.mark.slow
def test_greedy_tokens_and_env_actions_match_openpi(policy, ref):
    """Raw observation + prompt -> output tokens (exact) -> (10, 7) env actions, one observation at a time."""
    for i in range(ref["actions"].shape[0]):
        actions, info = predict_libero_action_chunk(policy, golden_env_obs(ref, i), str(ref["prompt"][i]),
                                                    return_info=True)
        np.testing.assert_array_equal(info["output_tokens"][0].numpy(), ref["model_output/tokens"][i])
        assert actions.shape == (10, 7) and actions.dtype == np.float64
        np.testing.assert_allclose(actions, ref["actions"][i], rtol=0, atol=1e-12)
        # the random model writes no "Action: ": openpi's zero chunk, flagged as not ok
        assert not info["ok"][0] and "Action: " in info["problems"][0]
    # batched over the rollout engine's adapter: the same tokens as each observation alone
    out = Pi0ChunkPolicy(policy).predict_chunks([golden_env_obs(ref, i) for i in range(2)], list(ref["prompt"]))
    np.testing.assert_array_equal(out.extras["output_tokens"], ref["model_output/tokens"])
    np.testing.assert_allclose(out.actions, ref["actions"], rtol=0, atol=1e-12)


def test_decode_path_matches_openpi(policy, ref):
    """A well-formed output through openpi's output transforms: extraction, unnormalize, absolute actions."""
    toks = ref["decode_path/model_output_tokens"]
    norm, ok, problems = policy.prompt.extract_actions(toks, 10, 7)
    assert ok.all(), problems
    np.testing.assert_allclose(norm, ref["decode_path/actions_extracted"], rtol=0, atol=1e-12)
    state = torch.from_numpy(ref["model_input/state"])
    acts = policy.postprocess_actions(torch.from_numpy(norm), state).numpy()
    np.testing.assert_allclose(acts, ref["decode_path/actions"], rtol=0, atol=1e-12)
    # best effort reads the same well-formed output identically
    best, _, _ = policy.prompt.extract_actions(toks, 10, 7, mode="best_effort")
    np.testing.assert_allclose(best, norm, rtol=0, atol=1e-12)


def test_malformed_output_gives_openpis_zeros_and_best_effort_on_request(policy, ref):
    toks = ref["decode_path/model_output_tokens"][:1].copy()
    n_prefix = len(policy.prompt.action_prefix)
    toks[0, n_prefix + 2] = 5  # a text token inside the action tokens: the FAST decode no longer fits 10 x 7
    norm, ok, problems = policy.prompt.extract_actions(toks, 10, 7)
    assert not ok[0] and problems[0]
    best, _, _ = policy.prompt.extract_actions(toks, 10, 7, mode="best_effort")
    assert np.abs(best).max() > 0.1  # a best-effort chunk exists ...
    np.testing.assert_array_equal(norm, np.zeros((1, 10, 7)))  # ... but openpi's default is the zero chunk
    with pytest.raises(ValueError, match="action decoding mode"):
        policy.prompt.extract_actions(toks, 10, 7, mode="nope")


def test_training_format_matches_openpi(policy, ref):
    """FASTTokenizer.tokenize(prompt, normalized state, normalized target) as openpi builds training examples."""
    for i in range(2):
        tokens, mask, ar, loss = policy.prompt.tokenize(str(ref["prompt"][i]), ref["transformed/state_normalized"][i],
                                                        ref["decode_path/target_normalized"][i])
        np.testing.assert_array_equal(tokens, ref["train_format/tokens"][i])
        np.testing.assert_array_equal(ar, ref["train_format/ar_mask"][i])
        np.testing.assert_array_equal(mask, ref["train_format/token_mask"][i])
        np.testing.assert_array_equal(loss, ref["train_format/loss_mask"][i])


@pytest.mark.slow
def test_openpi_bf16_params_tokens(policy_dir, ref):
    """Unmodified openpi serving restores params as bf16 (float32 compute); openpi_bf16_params reproduces it."""
    pol = load_policy(policy_dir, openpi_bf16_params=True)
    actions, info = predict_libero_action_chunk(pol, golden_env_obs(ref, 0), str(ref["prompt"][0]), return_info=True)
    np.testing.assert_array_equal(info["output_tokens"][0].numpy(), ref["model_output/tokens_bf16_params"][0])
    np.testing.assert_allclose(actions, ref["actions_bf16_params"][0], rtol=0, atol=1e-12)
