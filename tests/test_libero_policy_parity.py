"""openpi's whole pi0_libero policy path on raw LIBERO observations, against openpi's own outputs."""

import numpy as np
import pytest
import torch

from conftest import LIBERO_TINY, golden_env_obs
from pi0.policies.libero import construct_libero_observation, predict_libero_action_chunk
from pi0.modeling_pi0 import PI0Policy


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(LIBERO_TINY / "reference.npz"))


def test_model_inputs_match_openpi(converted_tiny, ref):
    policy = PI0Policy.from_pretrained(converted_tiny)
    n = ref["actions"].shape[0]
    observation, client = construct_libero_observation([golden_env_obs(ref, i) for i in range(n)], list(ref["prompt"]), policy)
    np.testing.assert_array_equal(client["image"], ref["client/image"])
    np.testing.assert_array_equal(client["wrist_image"], ref["client/wrist_image"])
    np.testing.assert_allclose(client["state"], ref["client/state"], atol=1e-12)
    inp = policy.prepare_inputs(observation)
    np.testing.assert_array_equal(inp["state"].numpy(), ref["model_input/state"])
    np.testing.assert_array_equal(inp["lang_tokens"].numpy(), ref["model_input/tokenized_prompt"])
    np.testing.assert_array_equal(inp["lang_masks"].numpy(), ref["model_input/tokenized_prompt_mask"])
    for img, mask, key in zip(inp["images"], inp["img_masks"], ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")):
        np.testing.assert_array_equal(img.permute(0, 2, 3, 1).numpy(), ref[f"model_input/image/{key}"])
        np.testing.assert_array_equal(mask.numpy(), ref[f"model_input/image_mask/{key}"])


def test_action_chunks_match_openpi(converted_tiny, ref):
    policy = PI0Policy.from_pretrained(converted_tiny)
    assert policy.config.delta_action_dims == 6  # inferred from the LIBERO asset id at conversion
    for i in range(ref["actions"].shape[0]):
        actions = predict_libero_action_chunk(policy, golden_env_obs(ref, i), str(ref["prompt"][i]), noise=ref["noise"][i])
        assert actions.shape == (50, 7) and actions.dtype == np.float64
        assert np.abs(actions - ref["actions"][i]).max() < 1e-4
    # The raw model output and the delta->absolute step, separately.
    observation, _ = construct_libero_observation(golden_env_obs(ref, 0), str(ref["prompt"][0]), policy)
    info = policy.predict_action_chunk_with_info(observation, torch.from_numpy(ref["noise"][:1]))
    assert np.abs(info["model_actions"].numpy() - ref["model_output/actions"][:1]).max() < 1e-4
    no_delta = PI0Policy.from_pretrained(converted_tiny, delta_action_dims=0)
    plain = predict_libero_action_chunk(no_delta, golden_env_obs(ref, 0), str(ref["prompt"][0]), noise=ref["noise"][0])
    assert np.abs(plain - ref["output/actions_delta_unnormalized"][0, :, :7]).max() < 1e-4


def test_openpi_serving_numerics_with_bf16_rounded_params(converted_tiny, ref):
    """Unmodified openpi serving rounds weights to bf16 (float32 compute); openpi_bf16_params reproduces it."""
    policy = PI0Policy.from_pretrained(converted_tiny, openpi_bf16_params=True)
    for i in range(ref["actions"].shape[0]):
        actions = predict_libero_action_chunk(policy, golden_env_obs(ref, i), str(ref["prompt"][i]), noise=ref["noise"][i])
        assert np.abs(actions - ref["actions_bf16_params"][i]).max() < 1e-4
        assert np.abs(actions - ref["actions"][i]).max() > 1e-3  # the rounding really changes the numbers
