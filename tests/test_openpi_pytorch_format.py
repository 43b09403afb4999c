"""openpi's PyTorch format, RLinf's layout and LeRobot's pi0 / pi05: key map (hand-checked), parity with openpi's
JAX and PyTorch outputs, strictness, norm-stats search, writing openpi's format back, the converter and stage 1.

Fixtures: ``../shared/golden/openpi_pytorch_tiny/{pi0,pi05}_{f32,bf16}`` (openpi's own converter and ``PI0Pytorch``)
and the JAX references beside them. Other fixtures like these are held out: every check is exact, not tuned.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GOLDEN, REPO, model_inputs, need_fixture
from pi0.conversion.foreign_keys import canonical_key, openpi_to_ours, ours_to_openpi
from pi0.errors import UserError, run_cli
from pi0.policies import load_policy

PT = GOLDEN / "openpi_pytorch_tiny"
TOK = GOLDEN / "openpi_libero_policy_tiny" / "tokenizer.model"
JAX_REF = {"pi0": GOLDEN / "openpi_pi0_tiny" / "reference.npz", "pi05": GOLDEN / "openpi_pi05_tiny" / "reference.npz"}
# the pi0.5 fixture was made with horizon 50 and 64 tokens (its README); pi05_libero fixes the rest
PI05 = dict(openpi_config="pi05_libero", action_horizon=50, max_token_len=64)
TOL = 1e-4
P = "paligemma_with_expert."


def script(name: str):
    """A top-level script of the repository as a module (its ``main``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(name).stem.lstrip("0123456789_"), REPO / name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def kw(model: str) -> dict:
    return dict(tokenizer=TOK, **(PI05 if model == "pi05" else {}))


def actions(policy, model: str, steps: int = 1, batch: int = 1) -> np.ndarray:
    """The model's actions on the JAX fixture's inputs and noise (float32 compute): 1 Euler step and the first sample
    (cheap, compared with ``actions_1step``) or the reference's 10 steps on the whole batch."""
    ref = {k: v[:batch] if np.ndim(v) else v for k, v in np.load(need_fixture(JAX_REF[model])).items()}
    with torch.no_grad():
        return policy.model.sample_actions(**model_inputs(ref), noise=torch.from_numpy(ref["noise"]),
                                           num_steps=steps).numpy()


def jax_actions(model: str, steps: int = 1, batch: int = 1) -> np.ndarray:
    """openpi JAX's reference for ``actions``' arguments."""
    ref = np.load(JAX_REF[model])
    return (ref["actions_1step"] if steps == 1 else ref["actions"])[:batch]


def one_line_error(match: str, fn, *args, **kwargs) -> str:
    """``fn`` raises a UserError on one line containing ``match``; returns the message."""
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert match in msg and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------- key map
def test_key_map_hand_checked():
    vlm_q = "layers.3.self_attn.q_proj.weight"
    # openpi's PaliGemma (HF >= 4.52 nesting) -> ours (paligemma.language_model.model / vision_tower / projector)
    assert openpi_to_ours(P + "paligemma.model.language_model." + vlm_q) == \
        P + "paligemma.language_model.model." + vlm_q
    assert openpi_to_ours(P + "paligemma.model.vision_tower.vision_model.post_layernorm.bias") == \
        P + "paligemma.vision_tower.vision_model.post_layernorm.bias"
    assert openpi_to_ours(P + "paligemma.model.multi_modal_projector.linear.weight") == \
        P + "paligemma.multi_modal_projector.linear.weight"
    # the tied embedding is stored as lm_head; the expert's lm_head is unused
    assert openpi_to_ours(P + "paligemma.lm_head.weight") == P + "paligemma.language_model.model.embed_tokens.weight"
    assert openpi_to_ours(P + "gemma_expert.lm_head.weight") is None
    ada = P + "gemma_expert.model.layers.0.input_layernorm.dense.bias"
    assert openpi_to_ours(ada) == ada and openpi_to_ours("time_mlp_in.weight") == "time_mlp_in.weight"
    assert ours_to_openpi(P + "paligemma.language_model.model.embed_tokens.weight") == P + "paligemma.lm_head.weight"
    assert ours_to_openpi(P + "paligemma.language_model.model.norm.weight") == \
        P + "paligemma.model.language_model.norm.weight"
    with pytest.raises(UserError, match="'paligemma_with_expert.paligemma.bogus.weight'"):
        openpi_to_ours(P + "paligemma.bogus.weight")
    with pytest.raises(UserError, match="optimality_embedding"):
        ours_to_openpi("optimality_embedding")
    # layouts -> openpi's names: LeRobot's "model." prefix, its legacy nesting, RLinf's FSDP wrappers
    assert canonical_key("model.state_proj.bias", "lerobot") == "state_proj.bias"
    assert canonical_key("model." + P + "paligemma.language_model.model." + vlm_q, "lerobot-legacy") == \
        P + "paligemma.model.language_model." + vlm_q
    assert canonical_key("model." + P + "paligemma.language_model.lm_head.weight", "lerobot-legacy") == \
        P + "paligemma.lm_head.weight"
    assert canonical_key("model." + P + "paligemma.vision_tower.vision_model.x", "lerobot-legacy") == \
        P + "paligemma.model.vision_tower.vision_model.x"
    assert canonical_key("_fsdp_wrapped_module." + P + "gemma_expert.model.norm.weight", "rlinf") == \
        P + "gemma_expert.model.norm.weight"


def test_key_map_inverts_openpi_converter_on_fixture():
    """Every key of openpi's file maps to ours and back to itself (except the unused expert head)."""
    keys = load_file(str(need_fixture(PT / "pi05_f32" / "model.safetensors")))
    for k in keys:
        ours = openpi_to_ours(k)
        assert ours is None and k == P + "gemma_expert.lm_head.weight" or ours_to_openpi(ours) == k, k


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("model", ["pi0", "pi05"])
def test_float32_file_gives_jax_actions(model):
    policy = load_policy(need_fixture(PT / f"{model}_f32"), **kw(model))
    assert policy.config.model.pi05 == (model == "pi05") and policy.config.model.dtype == "float32"
    assert int(np.load(JAX_REF[model])["num_steps"]) == 10
    err = np.abs(actions(policy, model, 10, 2) - jax_actions(model, 10, 2)).max()
    assert err < TOL, err


@pytest.mark.parametrize("model", ["pi0", "pi05"])
def test_bf16_file_in_float32_gives_openpi_pytorch_actions(model):
    d = need_fixture(PT / f"{model}_bf16")
    policy = load_policy(d, **kw(model))
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    # the first sample (the batch's two are independent; the float32 test runs both)
    err = np.abs(actions(policy, model, 10, 1) - np.load(d / "openpi_pytorch_actions.npy")[:1]).max()
    assert err < TOL, err


def test_settings_inferred_from_tensors_and_presets():
    pi0 = load_policy(PT / "pi0_bf16", tokenizer=TOK)
    c = pi0.config
    assert (c.model.paligemma.variant, c.model.vision.variant, c.model.vocab_size) == ("dummy", "mu/14", 1024)
    # pi0: z-score; the LIBERO asset id gives 6 delta dims, as the JAX path decides
    assert (c.normalization, c.delta_action_dims, c.model.action_horizon, c.model.max_token_len) == \
        ("zscore", 6, 50, 48)
    pi05 = load_policy(PT / "pi05_bf16", tokenizer=TOK, openpi_config="pi05_libero")
    c = pi05.config
    assert (c.normalization, c.delta_action_dims, c.discrete_state_input, c.model.action_horizon) == \
        ("quantile", 0, False, 10)
    one_line_error("--openpi_config NAME, one of pi05_libero, pi05_droid", load_policy, PT / "pi05_bf16", tokenizer=TOK)
    c = load_policy(PT / "pi05_bf16", tokenizer=TOK, delta_action_dims=0, discrete_state_input=True).config
    assert (c.normalization, c.delta_action_dims, c.discrete_state_input, c.model.max_token_len) == \
        ("quantile", 0, True, 200)
    one_line_error("pass --tokenizer PATH", load_policy, PT / "pi0_bf16")


# ---------------------------------------------------------------------------------------------- by tensors, not path
def _copy(src, dst):
    dst.mkdir(parents=True)
    for f in ("model.safetensors", "config.json"):
        (dst / f).symlink_to(src / f)
    shutil.copytree(src / "assets", dst / "assets")
    return dst


def test_model_type_comes_from_tensors_not_path(tmp_path):
    as_pi05 = _copy(PT / "pi0_f32", tmp_path / "pi05_libero_pytorch")
    policy = load_policy(as_pi05, tokenizer=TOK)
    assert not policy.config.model.pi05
    assert np.abs(actions(policy, "pi0") - jax_actions("pi0")).max() < TOL
    as_pi0 = _copy(PT / "pi05_f32", tmp_path / "pi0_libero")
    assert load_policy(as_pi0, **kw("pi05")).config.model.pi05
    one_line_error("pi0_droid is a pi0 config but the checkpoint holds a pi05", load_policy, as_pi0, tokenizer=TOK,
                   openpi_config="pi0_droid")


# ---------------------------------------------------------------------------------------------- strictness
def _edited(tmp_path, edit) -> object:
    d = _copy(PT / "pi0_f32", tmp_path / "ckpt")
    (d / "model.safetensors").unlink()
    tensors = load_file(str(PT / "pi0_f32" / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


QP = P + "paligemma.model.language_model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__(QP.replace("q_proj", "query"), t.pop(QP)),
     "unexpected key '" + QP.replace("q_proj", "query")),
    (lambda t: t.pop("action_out_proj.bias"), "missing key 'action_out_proj.bias'"),
    (lambda t: t.pop(P + "paligemma.lm_head.weight"), "missing key 'paligemma_with_expert.paligemma.lm_head.weight'"),
    (lambda t: t.__setitem__("value_head.out.weight", torch.zeros(1, 64)), "unexpected key 'value_head.out.weight'"),
    (lambda t: t.__setitem__("state_proj.bias", torch.zeros(63)), "shape mismatch for 'state_proj.bias'"),
])
def test_renamed_missing_extra_or_misshaped_key_names_it(tmp_path, edit, match):
    one_line_error(match, load_policy, _edited(tmp_path, edit), tokenizer=TOK)


def test_mixed_pi0_pi05_tree_is_refused(tmp_path):
    """A pi0 tree with pi0.5's time_mlp_in is a pi0.5 by its tensors, whose pi0-only heads are then refused."""
    d = _edited(tmp_path, lambda t: t.update({"time_mlp_in.weight": torch.zeros(64, 64), "time_mlp_in.bias":
                                              torch.zeros(64)}))
    one_line_error("holds a pi0.5", load_policy, d, tokenizer=TOK)
    one_line_error("unexpected key 'action_time_mlp_in.bias'", load_policy, d, tokenizer=TOK,
                   openpi_config="pi05_libero")


def test_no_norm_stats_says_where_they_come_from(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "model.safetensors").symlink_to(PT / "pi0_f32" / "model.safetensors")
    msg = one_line_error("no norm stats in", load_policy, d, tokenizer=TOK)
    for where in ("assets/<asset_id>/norm_stats.json", "<org>/<repo>/norm_stats.json", "policy_preprocessor",
                  "--norm_stats PATH"):
        assert where in msg, where
    given = load_policy(d, tokenizer=TOK, norm_stats=PT / "pi0_f32/assets/physical-intelligence/libero/norm_stats.json")
    assert given.config.delta_action_dims == 6


# ---------------------------------------------------------------------------------------------- RLinf and LeRobot
def test_rlinf_layout_and_converter(tmp_path):
    """RLinf: openpi's keys (here behind FSDP wrappers), norm stats at <org>/<repo>/norm_stats.json."""
    conv = script("convert_pi0_to_hf_lerobot.py")
    d = tmp_path / "RLinf-Pi0-LIBERO"
    (d / "physical-intelligence" / "libero").mkdir(parents=True)
    shutil.copy(PT / "pi0_f32/assets/physical-intelligence/libero/norm_stats.json", d / "physical-intelligence/libero")
    save_file({"_fsdp_wrapped_module." + k: v for k, v in load_file(str(PT / "pi0_f32/model.safetensors")).items()},
              str(d / "model.safetensors"))
    direct = actions(load_policy(d, tokenizer=TOK), "pi0")
    assert np.abs(direct - jax_actions("pi0")).max() < TOL
    out = tmp_path / "converted"
    conv.main(["--from", "rlinf", "--checkpoint_dir", str(d), "--output_path", str(out), "--tokenizer", str(TOK)])
    again = load_policy(out)
    assert again.config.delta_action_dims == 6 and sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "norm_stats.json", "tokenizer.model"]
    np.testing.assert_array_equal(actions(again, "pi0"), direct)
    with pytest.raises(UserError, match="in rlinf layout, not lerobot"):
        conv.main(["--from", "lerobot", "--checkpoint_dir", str(d), "--output_path", str(tmp_path / "x")])


def _lerobot_dir(tmp_path, model: str, legacy: bool = False):
    """A LeRobot pi0 / pi05 directory built from its published conventions (LeRobot 7427f31), with the fixture's
    weights and norm stats:
    - model.safetensors: every key under ``model.``; current releases use openpi's names and hold both
      ``...language_model.embed_tokens.weight`` and ``...lm_head.weight`` (its loader clones one into the other);
      legacy ones (``_transform_state_dict_keys`` of PR #1415 undoes them) nest ``paligemma.language_model.model.*``,
      ``paligemma.language_model.lm_head``, ``paligemma.{vision_tower,multi_modal_projector}`` and keep the stats as
      ``normalize_inputs.buffer_observation_state.{mean,std}`` / ``(un)normalize_*.buffer_action.*`` buffers.
    - config.json with ``"type"``, ``chunk_size``, ``tokenizer_max_length``, ``normalization_mapping``.
    - processor files as ``PolicyProcessorPipeline.save_pretrained`` names them:
      ``policy_preprocessor_step_<i>_normalizer_processor.safetensors`` (i = the normalizer's index: pi0 5, pi05 3)
      and ``policy_postprocessor_step_<j>_unnormalizer_processor.safetensors`` (pi0 1, pi05 0), flat keys
      ``<feature>.<stat>`` (``observation.state.mean``, ``action.q01``), with the pipelines' JSON beside them.
    """
    src = PT / f"{model}_f32"
    d = tmp_path / f"lerobot_{model}"
    d.mkdir()
    tensors = {f"model.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    ns = json.loads((src / "assets/physical-intelligence/libero/norm_stats.json").read_text())["norm_stats"]
    mode = "QUANTILES" if model == "pi05" else "MEAN_STD"
    if legacy:
        for old, new in ((P + "paligemma.model.language_model.", P + "paligemma.language_model.model."),
                         (P + "paligemma.lm_head.", P + "paligemma.language_model.lm_head."),
                         (P + "paligemma.model.vision_tower.", P + "paligemma.vision_tower."),
                         (P + "paligemma.model.multi_modal_projector.", P + "paligemma.multi_modal_projector.")):
            tensors = {k.replace("model." + old, "model." + new): v for k, v in tensors.items()}
        for buf, feat, key in (("normalize_inputs", "observation_state", "state"), ("normalize_targets", "action",
                               "actions"), ("unnormalize_outputs", "action", "actions")):
            for stat in ("mean", "std"):
                tensors[f"{buf}.buffer_{feat}.{stat}"] = torch.tensor(ns[key][stat], dtype=torch.float32)
    else:
        lm = tensors[f"model.{P}paligemma.lm_head.weight"]
        tensors[f"model.{P}paligemma.model.language_model.embed_tokens.weight"] = lm.clone()
        pre_i, post_i = (3, 0) if model == "pi05" else (5, 1)
        flat = {f"{f}.{s}": torch.tensor(v, dtype=torch.float32)
                for f, k in (("observation.state", "state"), ("action", "actions")) for s, v in ns[k].items()}
        save_file(flat, str(d / f"policy_preprocessor_step_{pre_i}_normalizer_processor.safetensors"))
        save_file({k: v for k, v in flat.items() if k.startswith("action.")},
                  str(d / f"policy_postprocessor_step_{post_i}_unnormalizer_processor.safetensors"))
        norm_map = {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
        (d / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
            {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "norm_map": norm_map},
             "state_file": f"policy_preprocessor_step_{pre_i}_normalizer_processor.safetensors"}]}))
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "type": model, "chunk_size": 50, "n_action_steps": 50, "tokenizer_max_length": 64 if model == "pi05" else 48,
        "num_inference_steps": 10, "max_state_dim": 32, "max_action_dim": 32,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
        **({} if legacy else {"paligemma_variant": "dummy", "action_expert_variant": "dummy"})}))
    return d, ns


@pytest.mark.parametrize("model, legacy", [("pi0", False), ("pi05", False), ("pi0", True)])
def test_lerobot_layouts(tmp_path, model, legacy):
    d, ns = _lerobot_dir(tmp_path, model, legacy)
    policy = load_policy(d, tokenizer=TOK)
    c = policy.config
    assert (c.model.pi05, c.normalization, c.discrete_state_input, c.delta_action_dims) == \
        (model == "pi05", "quantile" if model == "pi05" else "zscore", model == "pi05", 0)
    np.testing.assert_allclose(policy.norm_stats["actions"].std, ns["actions"]["std"], rtol=1e-6)
    assert np.abs(actions(policy, model) - jax_actions(model)).max() < TOL


# ---------------------------------------------------------------------------------------------- writing openpi's format
@pytest.mark.parametrize("name", ["pi05_f32", "pi0_bf16"])
def test_save_openpi_pytorch_matches_openpi_files(tmp_path, name):
    """Keys, shapes, dtypes, metadata and values as openpi's converter wrote them; the expert's unused lm_head (random
    in openpi's file) is written as zeros. Loading the written directory gives the same actions."""
    from safetensors import safe_open

    model = name.split("_")[0]
    src = PT / name
    policy = load_policy(src, **kw(model))
    out = policy.save_pretrained(tmp_path / "openpi", format="openpi-pytorch",
                                 dtype="bfloat16" if name.endswith("bf16") else None)
    ref, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        if k != P + "gemma_expert.lm_head.weight":
            assert torch.equal(got[k], v), k
    assert not got[P + "gemma_expert.lm_head.weight"].any()
    with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert a.metadata() == b.metadata()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert json.loads((out / "assets/physical-intelligence/libero/norm_stats.json").read_text())["norm_stats"].keys() \
        == {"state", "actions"}
    again = load_policy(out, **kw(model))
    np.testing.assert_array_equal(actions(again, model), actions(policy, model))


# ---------------------------------------------------------------------------------------------- stage 1
@pytest.mark.parametrize("name", ["1_e2e_inference.py", "scripts/serve_policy.py"])
def test_stage1_and_server_name_what_they_found_and_expected(tmp_path, capsys, name):
    main = script(name).main
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--checkpoint", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    assert "found weights.bin" in err and "expected our policy directory" in err and "LeRobot pi0/pi05" in err
    if name.startswith("scripts"):
        return
    d = tmp_path / "other"
    d.mkdir()
    save_file({"encoder.weight": torch.zeros(2)}, str(d / "model.safetensors"))
    with pytest.raises(SystemExit):
        run_cli(main, ["--checkpoint", str(d)])
    err = capsys.readouterr().err.strip()
    assert "found model.safetensors with keys under ['encoder.'] and no config.json; expected" in err, err


def test_rl_config_checks_foreign_checkpoints(tmp_path):
    """The RL stages' task.checkpoint: a foreign directory is checked from headers when the config loads."""
    from pi0.ript.config.schema import load_config

    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(UserError, match=r"task.checkpoint: .*found weights.bin; expected our policy directory"):
        load_config("debug_train_pi0", [f"task.checkpoint={tmp_path}"])
    with pytest.raises(UserError, match="task.checkpoint: no tokenizer.model in"):
        load_config("debug_train_pi0", [f"task.checkpoint={PT / 'pi0_bf16'}"])
    cfg = load_config("debug_train_pi0", [f"task.checkpoint={PT / 'pi05_bf16'}", f"task.tokenizer={TOK}",
                                          "task.openpi_config=pi05_libero"])
    assert cfg.task.openpi_config == "pi05_libero"


def test_shapes_through_the_key_map_match_openpi_files_and_full_size():
    """openpi's JAX tree through our two key maps gives openpi's PyTorch keys and shapes: equal to the fixture's file
    (tiny) and, at full size (the shared shapes file), a tree whose inferred config is openpi's default pi0 / pi0.5."""
    from pi0.conversion.foreign_keys import infer_config, plan_load
    from pi0.conversion.zero_checkpoint import openpi_param_shapes, openpi_pytorch_shapes
    from pi0.models.config import Pi0Config
    from pi0.models.pi0 import PI0Model
    from pi0.utils.checkpoint_io import read_safetensors_header

    for name, pi05 in (("pi0_f32", False), ("pi05_bf16", True)):
        header = {k: e.shape for k, e in read_safetensors_header(PT / name / "model.safetensors").items()}
        assert openpi_pytorch_shapes(Pi0Config.tiny(pi05=pi05)) == header, name
    for model, pi05 in (("pi0", False), ("pi05", True)):
        full = json.loads((GOLDEN / f"openpi_{model}_full_shapes.json").read_text())["shapes"]
        cfg = Pi0Config(pi05=pi05)
        assert openpi_param_shapes(cfg) == {k: tuple(v) for k, v in full.items()}
        shapes = openpi_pytorch_shapes(cfg)
        assert shapes[P + "paligemma.lm_head.weight"] == (257_152, 2048)
        assert infer_config(shapes, action_horizon=50) == cfg  # heads from the unique gemma_2b / gemma_300m sizes
        assert infer_config(shapes, "gemma_2b_lora", "gemma_300m_lora") == cfg  # openpi's LoRA variant names
        with pytest.raises(UserError, match="VLM variant 'gemma_300m' does not match the tensors"):
            infer_config(shapes, "gemma_300m")
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in PI0Model(cfg).state_dict().items()}
        assert len(plan_load(shapes, expected)) == len(expected)
