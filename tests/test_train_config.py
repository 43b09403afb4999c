"""Config tree (presets, validation, feature flags), user errors of the stage scripts, resume, distributed runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_TRAIN, torchrun
from pi0.errors import UserError
from pi0.ript.config import load_config, presets
from pi0.ript.config.schema import TrainConfig, apply_features, save_config

TINY = TINY_TRAIN


@pytest.mark.parametrize("name", presets())
def test_every_preset_loads_and_validates(name):
    cfg = load_config(name, check_paths=not name.startswith(("libero", "single_gpu", "distributed")))
    assert cfg.algo.group_size >= 2 and cfg.task.task_ids


def test_required_presets_are_bundled():
    need = {"stage7_rl_core", "stage8_epochs", "debug_train_pi0", "train_pi0_cfg_rl", "single_gpu_test",
            "multi_env_test", "distributed_train_pi0", "debug_distributed_train", "stage11_ript_vla", "libero_spatial",
            "libero_object", "libero_goal", "libero_10", "libero_90"}
    assert need <= set(presets())


@pytest.mark.parametrize("override, words", [
    (["algo.bogus=1"], ["algo.bogus", "allowed keys", "group_size"]),
    (["env.runner.nope=1"], ["env.runner.nope", "num_envs"]),
    (["algo.iterations=abc"], ["algo.iterations", "Integer"]),
    (["algo.group_size=1"], ["algo.group_size", ">= 2"]),
    (["algo.p_uncond=1.5"], ["algo.p_uncond", "[0, 1]"]),
    (["algo.demo_coef=-1"], ["algo.demo_coef", ">= 0"]),
    (["algo.demo_coef=1", "task.env=libero"], ["algo.demo_coef=1 (RL's demo anchor) trains on the tiny warm start's "
                                               "demos, and task.env=libero has none", "set algo.demo_coef=0"]),
    (["task.task_ids=[7]"], ["task.task_ids", "0..4"]),
    (["task.checkpoint=/no/such/dir"], ["task.checkpoint", "does not exist"]),
    (["task.env=mujoco"], ["task.env", "arena"]),
    (["distributed.backend=mpi"], ["distributed.backend", "gloo"]),
    (["algo.iterations"], ["key=value"]),
    (["algo.anchor_ratio=1"], ["algo.anchor_ratio"]),  # deleted options are unknown keys now
    (["algo.objective=grpo"], ["algo.objective", "'ppo', 'cfg'"]),
    (["algo.trainable=vision"], ["algo.trainable", "'all', 'expert', 'lora'"]),
    (["algo.precision=fp16"], ["algo.precision", "'float32', 'bf16'"]),
    (["task.warm_start_patience=3"], ["task.warm_start_patience", "overlap", "task.eval_start"]),
    (["task.warm_start_patience=-1"], ["task.warm_start_patience", ">= 0"]),
    (["task.warm_start_procs=3"], ["task.warm_start_minibatch=32", "task.warm_start_procs=3", "multiple"]),
    (["task.warm_start_procs=0"], ["task.warm_start_procs", ">= 1"]),
    (["task.warm_start_seed=-1"], ["task.warm_start_seed", ">= 0"]),
    (["task.warm_start_cooldown=-5"], ["task.warm_start_cooldown", ">= 0"]),
])
def test_bad_config_names_key_and_allowed(override, words):
    with pytest.raises(UserError) as e:
        load_config("debug_train_pi0", override)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_make_run_preset_with_a_checkpoint_names_every_demo_setting_in_one_error(tmp_path):
    """Stage 11's preset trains continued SFT and RL's demo anchor on the tiny start's demos: a user's checkpoint has
    none, and the one error names both fixes."""
    from pi0.policies.presets import tiny_policy
    tiny_policy().save_pretrained(tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        load_config("stage11_ript_vla", [f"task.checkpoint={tmp_path / 'ckpt'}"])
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("set baseline.sft=false algo.demo_coef=0"), msg
    assert "baseline.sft=true (continued SFT) and algo.demo_coef=1 (RL's demo anchor) train on" in msg, msg
    cfg = load_config("stage11_ript_vla", [f"task.checkpoint={tmp_path / 'ckpt'}", "baseline.sft=false",
                                           "algo.demo_coef=0"])
    assert cfg.task.checkpoint and cfg.algo.demo_coef == 0


def test_warm_start_seed_trains_an_independent_start(tmp_path):
    """task.warm_start_seed: another seed is another start (its own init, demo noise and cache entry); the default
    seed 0 reuses its cache."""
    import json
    from pi0.ript.utils.train_loop import tiny_warm_start
    starts = {}
    for seed in (0, 1, 0):
        cfg = load_config("debug_train_pi0", TINY + [f"logging.out_dir={tmp_path}", f"task.warm_start_seed={seed}"])
        policy, _ = tiny_warm_start(cfg)
        starts.setdefault(seed, []).append(policy.model.action_out_proj.weight.detach().clone())
    entries = sorted((tmp_path / "cache" / "ript_warm_start").iterdir())
    assert len(entries) == 2 and {json.loads((e / "warm_start.json").read_text())["config"]["seed"]
                                  for e in entries} == {0, 1}
    assert torch.equal(starts[0][0], starts[0][1]) and not torch.equal(starts[0][0], starts[1][0])


def test_overrides_and_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo: {iterations: 7}\nlogging: {run_name: x}\n")
    cfg = load_config(str(p), ["algo.opt.lr=0.01", "task.task_ids=[1,2]"])
    assert (cfg.algo.iterations, cfg.algo.opt.lr, cfg.task.task_ids, cfg.logging.run_name) == (7, 0.01, [1, 2], "x")


def test_feature_flags_switch_the_runner_and_sampling():
    cfg = TrainConfig()
    cfg.algo.num_groups, cfg.algo.group_size = 3, 4
    cfg.features.enable_parallel_envs = cfg.features.use_ript_vla_runner = True
    cfg.features.enable_smart_sampling = False
    apply_features(cfg)
    r = cfg.env.runner
    assert (r.use_subprocess, r.schedule, r.num_envs, r.group_size) == (True, "grouped", 12, 4)
    assert cfg.algo.dynamic_sampling is False
    off = apply_features(TrainConfig())
    assert (off.env.runner.use_subprocess, off.env.runner.schedule, off.algo.dynamic_sampling) == (False, "greedy", True)


@pytest.mark.parametrize("key, instead", [
    ("env.runner.use_subprocess=true", "features.enable_parallel_envs"),
    ("env.runner.schedule=grouped", "features.use_ript_vla_runner"),
    ("env.runner.group_size=4", "features.use_ript_vla_runner"),
    ("algo.dynamic_sampling=false", "features.enable_smart_sampling"),
])
def test_one_name_per_setting(tmp_path, key, instead):
    """A derived key is refused, from the command line or a YAML file, with the one key to set instead."""
    with pytest.raises(UserError, match=f"the command line sets {key.split('=')[0]}, which is derived from {instead}"):
        load_config("debug_train_pi0", [key])
    dotted, value = key.split("=")
    yaml = tmp_path / "c.yaml"
    *parents, leaf = dotted.split(".")
    yaml.write_text("".join(f"{'  ' * i}{k}:\n" for i, k in enumerate(parents)) + f"{'  ' * len(parents)}{leaf}: {value}\n")
    with pytest.raises(UserError, match=f"config file {yaml} sets {dotted}, which is derived from {instead}"):
        load_config(str(yaml))


def test_ript_vla_num_envs_defaults_to_all_groups_and_saved_config_reloads(tmp_path):
    flags = ["features.use_ript_vla_runner=true", "algo.num_groups=3", "algo.group_size=2"]
    assert load_config("debug_train_pi0", flags, check_paths=False).env.runner.num_envs == 4  # the preset's 4
    cfg = load_config(None, flags, check_paths=False)
    assert (cfg.env.runner.num_envs, cfg.env.runner.schedule, cfg.env.runner.group_size) == (6, "grouped", 2)
    saved = save_config(cfg, tmp_path / "config.yaml")
    assert "use_subprocess" not in saved.read_text() and "dynamic_sampling" not in saved.read_text()
    again = load_config(str(saved), check_paths=False)
    assert again.env.runner == cfg.env.runner and again.algo == cfg.algo


@pytest.mark.parametrize("args", [
    ["9_train_with_config.py", "--config_path", "debug_train_pi0", "algo.bogus=1"],
    ["10_train_with_distributed.py", "--config_path", "debug_distributed_train", "task.task_ids=[9]"],
    ["11_train_ript_vla_style.py", "task.checkpoint=/no/ckpt"],
    ["11_train_ript_vla_style.py", "--config_path", "/no/such.yaml"],
    ["2_test_pi0_on_libero.py", "--task_ids", "42"],
    ["1_e2e_inference.py", "--checkpoint", "/no/ckpt"],
    ["convert_pi0_to_hf_lerobot.py", "--checkpoint_dir", "/no/params", "--output_path", "/tmp/x"],
])
def test_user_errors_are_one_line_exit_2(args):
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def _params(policy_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(policy_dir) / "model.safetensors"))


@pytest.mark.parametrize("algo", [
    # PPO: the optimizer (weight decay moves the weights even where this tiny start's advantages are all 0), and the
    # demo anchor's draws and flow noise (algo.demo_coef: the start's demo windows reach the trainer)
    ["algo.objective=ppo", "algo.opt.epochs=2", "algo.opt.weight_decay=0.1", "algo.demo_coef=0.5"],
    ["algo.objective=cfg", "algo.trainable=expert"],
], ids=["ppo", "cfg_expert"])
def test_resume_reproduces_uninterrupted_run(tmp_path, algo):
    from pi0.ript.utils.train_loop import train
    common = TINY + [f"logging.out_dir={tmp_path}", "algo.eval_every=0", "logging.plot=false", *algo]
    full = train(load_config("debug_train_pi0", common + ["logging.run_name=full", "algo.iterations=2"]))
    train(load_config("debug_train_pi0", common + ["logging.run_name=cut", "algo.iterations=1"]))
    resumed = train(load_config("debug_train_pi0", common + ["logging.run_name=cut", "algo.iterations=2"]),
                    resume=True)
    a, b = _params(tmp_path / "full" / "final"), _params(tmp_path / "cut" / "final")
    assert full[-1]["steps"] > 0 and len(resumed) == 2
    assert ("demo_loss" in full[-1]) == ("algo.demo_coef=0.5" in algo)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    one = _params(tmp_path / "cut" / "checkpoints" / "iter_0001")
    assert max(float((a[k] - one[k]).abs().max()) for k in a) > 0  # the second iteration did change the params


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    from pi0.ript.checkpoint import latest_checkpoint
    from pi0.ript.utils.train_loop import train
    train(load_config("debug_train_pi0", TINY + [f"logging.out_dir={tmp_path}", "algo.iterations=1",
                                                 "algo.eval_every=0", "logging.plot=false"]))
    run = tmp_path / "debug_train_pi0"
    (run / "checkpoints" / "iter_0002.tmp").mkdir()  # a save killed before its rename
    (run / "checkpoints" / "iter_0002.tmp" / "model.safetensors").write_bytes(b"partial")
    ck = latest_checkpoint(run)
    assert ck is not None and ck.name == "iter_0001" and (ck / "rank0.pt").is_file()
    assert set(_params(ck)) == set(_params(run / "final"))


@pytest.mark.slow
@pytest.mark.parametrize("script", ["10_train_with_distributed.py", "11_train_ript_vla_style.py"])
def test_torchrun_two_gloo_ranks_one_iteration(tmp_path, script):
    extra = (["features.enable_parallel_envs=true", "features.use_ript_vla_runner=true"] if script.startswith("11")
             else ["distributed.counter=store"])  # stage 10 here: the c10d store counter (multi-node path)
    out = torchrun(script, "--config_path", "debug_distributed_train", *TINY, *extra, f"logging.out_dir={tmp_path}",
                    "algo.iterations=1")
    assert "iter 1: success" in out and out.count("iter 1: success") == 1  # logged on rank 0 only
    run = tmp_path / "debug_distributed_train"
    assert (run / "config.yaml").is_file() and (run / "final" / "model.safetensors").is_file()
    assert {p.name for p in (run / "checkpoints" / "iter_0001").glob("rank*.pt")} == {"rank0.pt", "rank1.pt"}


def test_no_deadlock_when_one_rank_has_no_groups():
    out = torchrun(str(Path(__file__).parent / "dist_no_deadlock_worker.py"), timeout=180)
    # torchrun interleaves the ranks' stdout (two reports can share a line): match the reports, not lines
    steps = sorted(re.findall(r"rank (\d+) steps (\d+) windows (\d+) params_equal (True|False) released (True|False)",
                              out))
    assert [s[0] for s in steps] == ["0", "1"] and steps[1][2] == "0", out  # rank 1 had no data
    n0, n1 = (int(s[1]) for s in steps)
    assert n0 == n1 > 0 and all(s[3] == "True" for s in steps)
    assert all(s[4] == "True" for s in steps), out  # cleanup_distributed freed the group (its gloo threads)


def test_system_check_reports_pass_and_fix(tmp_path):
    ok = subprocess.run([sys.executable, "quick_single_gpu_test.py", "--config_path", "debug_train_pi0",
                         f"logging.out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "6/6 checks passed" in ok.stdout, ok.stdout + ok.stderr
    assert "[PASS] rollout+update  2 rollouts of 10 steps + 1 update step(s)" in ok.stdout  # the real training code
    bad = subprocess.run([sys.executable, "quick_single_gpu_test.py", "--config_path", "debug_train_pi0",
                          f"task.checkpoint={tmp_path}", "device=cuda:7" if not torch.cuda.is_available() else
                          "device=cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "[FAIL] checkpoint" in bad.stdout and "fix: convert weights" in bad.stdout
    assert "[FAIL] rollout+update  skipped" in bad.stdout


def test_flags_save_video_and_no_resume_state(tmp_path):
    from pi0.ript.utils.train_loop import train
    train(load_config("debug_train_pi0", TINY + [f"logging.out_dir={tmp_path}", "algo.iterations=1",
                                                 "features.save_video=true", "logging.num_videos=1",
                                                 "features.save_resume_state=false"]))
    run = tmp_path / "debug_train_pi0"
    assert len(list((run / "videos").glob("*.mp4"))) == 1
    assert not (run / "checkpoints").exists() and (run / "final" / "model.safetensors").is_file()
    assert (run / "success.png").is_file() and list((run / "tb").iterdir())


def test_global_counter_stops_collection_once_all_ranks_have_enough(tmp_path):
    from pi0.ript.algos.rl_optimizers.file_counter import FileGlobalCounter
    from pi0.ript.init_states import InitStateSampler
    from pi0.ript.collection import RolloutGenerator

    class NoRunner:
        def run(self, *a, **k):
            raise AssertionError("collection should not start: the other ranks already kept enough groups")

    gen = RolloutGenerator(NoRunner(), None, InitStateSampler({0: [0, 1]}), group_size=2)
    counter = FileGlobalCounter(tmp_path / "c")
    counter.update(4)
    col = gen.collect(2, counter, global_target=4)
    assert (len(col.groups), col.attempts, col.num_groups) == (0, 0, 0)
