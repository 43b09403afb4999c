"""PI0Policy: tokenizer format, save/load, action queue and clear errors on bad input."""

import json

import numpy as np
import pytest
import torch

from conftest import LIBERO_TINY
from pi0.modeling_pi0 import PI0Policy
from pi0.policies.presets import synthetic_observation, tiny_policy
from pi0.policies.tokenizer import PaligemmaTokenizer, clean_prompt


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(seed=1, n_action_steps=3)


@pytest.fixture(scope="module")
def saved(policy, tmp_path_factory):
    return policy.save_pretrained(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_tokenizer_matches_openpi_fixture():
    ref = np.load(LIBERO_TINY / "reference.npz")
    tok = PaligemmaTokenizer(LIBERO_TINY / "tokenizer.model", 48)
    ids, mask = tok([str(p) for p in ref["prompt"]])
    np.testing.assert_array_equal(ids.numpy(), ref["model_input/tokenized_prompt"])
    np.testing.assert_array_equal(mask.numpy(), ref["model_input/tokenized_prompt_mask"])
    assert clean_prompt("  open_the drawer\n") == "open the drawer"


def test_long_prompt_truncated_with_warning():
    tok = PaligemmaTokenizer(LIBERO_TINY / "tokenizer.model", 8)
    with pytest.warns(UserWarning, match="truncating"):
        ids, mask = tok(["put the black bowl on the plate and then open the drawer"])
    assert ids.shape == (1, 8) and bool(mask.all())
    assert int(ids[0, 0]) == 2  # BOS survives truncation


def test_save_load_roundtrip(policy, saved):
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors", "norm_stats.json",
                                                      "tokenizer.model"]
    loaded = PI0Policy.from_pretrained(saved)
    obs = synthetic_observation(policy, batch_size=2)
    noise = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(0))
    a = policy.predict_action_chunk(obs, noise=noise)
    b = loaded.predict_action_chunk(obs, noise=noise)
    assert a.shape == (2, 50, 7)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert loaded.config.n_action_steps == 3 and loaded.config.delta_action_dims == 6


def test_missing_camera_is_masked_zero_image(policy):
    obs = synthetic_observation(policy, batch_size=1)
    inp = policy.prepare_inputs(obs)
    assert [bool(m[0]) for m in inp["img_masks"]] == [True, True, False]
    assert torch.all(inp["images"][2] == -1.0)  # uint8 zeros -> -1 in [-1, 1]
    noise = torch.zeros(1, 50, 32)
    explicit = dict(obs, image={**obs["image"], "right_wrist_0_rgb": torch.full((1, 3, 224, 224), 200, dtype=torch.uint8)})
    # A masked camera cannot change the actions... but a provided one is unmasked, so it must.
    assert not torch.allclose(policy.predict_action_chunk(obs, noise), policy.predict_action_chunk(explicit, noise))


def test_select_action_replans_every_n_steps(policy, monkeypatch):
    calls = []
    orig = policy.predict_action_chunk

    def spy(obs, noise=None):
        calls.append(1)
        return orig(obs, noise)

    monkeypatch.setattr(policy, "predict_action_chunk", spy)
    policy.reset()
    obs = synthetic_observation(policy, batch_size=2)
    acts = [policy.select_action(obs) for _ in range(7)]
    assert len(calls) == 3  # steps 0, 3, 6 with n_action_steps=3
    assert acts[0].shape == (2, 7)
    policy.reset()


@pytest.mark.parametrize("mutate, match", [
    (lambda o: o["image"].update(base_0_rgb=o["image"]["base_0_rgb"].float()), "must be uint8"),
    (lambda o: o["image"].update(base_0_rgb=o["image"]["base_0_rgb"][:, :, :100]), r"\(B, 3, 224, 224\)"),
    (lambda o: o["image"].update(top_cam=o["image"]["base_0_rgb"]), "unknown camera key.*top_cam"),
    (lambda o: o.update(state=o["state"][:, :5]), r"state must be \(B, 8\)"),
    (lambda o: o.update(prompt=["a", "b", "c"]), "3 prompts for a batch of 1"),
])
def test_bad_observation_errors(policy, mutate, match):
    obs = synthetic_observation(policy)
    obs["image"] = dict(obs["image"])
    mutate(obs)
    with pytest.raises(ValueError, match=match):
        policy.predict_action_chunk(obs)


def test_bad_checkpoint_dirs(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PI0Policy.from_pretrained(tmp_path / "missing")
    broken = tmp_path / "no_stats"
    broken.mkdir()
    for f in ("model.safetensors", "config.json", "tokenizer.model"):
        (broken / f).write_bytes((saved / f).read_bytes())
    with pytest.raises(FileNotFoundError, match="norm_stats.json"):
        PI0Policy.from_pretrained(broken)
    (broken / "norm_stats.json").write_bytes((saved / "norm_stats.json").read_bytes())
    data = (saved / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        PI0Policy.from_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="not a safetensors file"):
        PI0Policy.from_pretrained(broken)
    (broken / "model.safetensors").write_bytes(data)
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model"]["action_expert"]["width"] = 32  # weights no longer fit the config
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape mismatch"):
        PI0Policy.from_pretrained(broken)
    cfg["bogus_key"] = 1
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bogus_key"):
        PI0Policy.from_pretrained(broken)
