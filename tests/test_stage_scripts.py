"""The stage scripts run end to end as users launch them (tiny embedded default, fast built-in env)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

# Stages 7/8 from their presets, shrunk to one tiny iteration (a few seconds on CPU).
TINY_RL = ["algo.iterations=1", "algo.num_groups=2", "algo.group_size=2", "task.train_states=4", "task.eval_start=4",
           "task.eval_states=1", "task.warm_start_demos=2", "task.warm_start_steps=5", "env.runner.num_envs=4",
           "env.runner.max_steps=15"]


def _run(*args: str, timeout: int = 300) -> str:
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_stage1_default_prints_chunk_and_time():
    out = _run("1_e2e_inference.py", "--num_steps", "3")
    assert "action chunk (1, 50, 7)" in out and "ms for batch 1, 3 Euler steps" in out


def test_stage1_bad_checkpoint_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "1_e2e_inference.py", "--checkpoint", str(tmp_path / "nope")], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "does not exist" in r.stderr and "convert_pi0_to_hf_lerobot.py" in r.stderr


def test_stage5_single_rollout_writes_video(tmp_path):
    out = _run("scripts/5_single_rollout.py", "--env", "arena", "--task_id", "1", "--max_steps", "20",
               "--out_dir", str(tmp_path))
    assert "after 20 steps, 4 policy calls" in out
    assert len(list(tmp_path.glob("arena_arena_task1_init0_*.mp4"))) == 1


def test_stage6_batches_groups_over_workers():
    out = _run("scripts/6_batched_rollouts.py", "--env", "arena", "--task_ids", "0", "1", "--group_size", "2",
               "--num_envs", "2", "--max_steps", "10")
    assert out.count("10 steps, 2 decisions") == 4
    assert "mean batch 2.00" in out  # the two members of a group share every policy call
    rss = out.split("worker RSS (MB): ")[1]
    assert all(int(x) < 150 for x in rss.split("]")[0].strip("[").split(","))  # ~45 MB: no model, not even torch, in workers (234 MB if the script re-imported)


@pytest.mark.libero
def test_stage3_env_smoke(tmp_path):
    out = _run("scripts/3_env_smoke.py", "--steps", "5", "--out_dir", str(tmp_path))
    assert "agentview_image" in out and len(list(tmp_path.glob("*.mp4"))) == 1


@pytest.mark.parametrize("script, run_name", [("7_train_with_rl_core.py", "stage7_rl_core"),
                                              ("8_train_with_epochs.py", "stage8_epochs")])
def test_stage7_and_8_run_from_their_presets(tmp_path, script, run_name):
    from pi0.modeling_pi0 import PI0Policy
    from pi0.ript.config import load_config

    out = _run(script, *TINY_RL, f"logging.out_dir={tmp_path}")
    assert "iter 1: success" in out and "iter 2" not in out
    run = tmp_path / run_name
    cfg = load_config(str(run / "config.yaml"))  # the resolved config, saved with the run, loads back
    stage8 = script.startswith("8")
    assert (cfg.algo.iterations, cfg.task.train_states, cfg.features.enable_smart_sampling) == (1, 4, stage8)
    assert cfg.algo.dynamic_sampling is stage8 and cfg.algo.opt.epochs == (2 if stage8 else 1)
    assert (run / "checkpoints" / "iter_0001" / "model.safetensors").is_file() and any((run / "tb").iterdir())
    assert cfg.algo.objective == "ppo"  # LOOP: no optimality condition in the saved policy
    assert not PI0Policy.from_pretrained(run / "final").config.model.optimality_condition
    assert [c["iteration"] for c in json.loads((run / "curve.json").read_text())] == [0.0, 1.0]  # before RL, iter 1
    if stage8:
        hist = json.loads((run / "history.json").read_text())
        assert hist["reprobe_after"] == 3 and {e["task_id"] for e in hist["states"]} == {4}
    else:
        assert not (run / "history.json").exists()


@pytest.mark.parametrize("args, words", [
    (["7_train_with_rl_core.py", "algo.nonexistent=1"], ["algo.nonexistent", "allowed keys", "num_groups"]),
    (["7_train_with_rl_core.py", "features.enable_smart_sampling=true"],
     ["features.enable_smart_sampling", "allowed: False", "8_train_with_epochs.py"]),
    (["7_train_with_rl_core.py", "--config_path", "train_pi0_cfg_rl"], ["features.enable_smart_sampling"]),
    (["7_train_with_rl_core.py", "features.enable_smart_sampling=false", "algo.opt.epochs=2"],
     ["algo.opt.epochs", "allowed: 1"]),
    (["8_train_with_epochs.py", "task.checkpoint=/no/ckpt"], ["task.checkpoint", "does not exist"]),
    (["8_train_with_epochs.py", "algo.opt.epochs=0"], ["algo.opt.epochs", ">= 1"]),
    (["8_train_with_epochs.py", "--config_path", "/no/such.yaml"], ["--config_path", "does not exist"]),
])
def test_stage7_and_8_user_errors_name_the_key(args, words):
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]


def test_stage7_and_8_refuse_torchrun(monkeypatch):
    from pi0.errors import UserError
    from pi0.ript.config import StageRules, load_config

    rules = StageRules("8_train_with_epochs.py", single_process=True)
    cfg = load_config("stage8_epochs")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="single-process .* WORLD_SIZE=2"):
        rules.check(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rules.check(cfg) is cfg


@pytest.mark.libero
@pytest.mark.slow
@pytest.mark.parametrize("script, run_name", [("7_train_with_rl_core.py", "stage7_rl_core"),
                                              ("8_train_with_epochs.py", "stage8_epochs")])
def test_stage7_and_8_libero_smoke(tmp_path, script, run_name):
    out = _run(script, "task.env=libero", "task.suite=libero_spatial", "task.task_ids=[0]",
               "features.enable_parallel_envs=true", "env.runner.num_envs=2", "env.runner.max_steps=10",
               "algo.iterations=1", "algo.num_groups=1", "algo.group_size=2", "algo.max_collect_attempts=1",
               "task.eval_states=1", f"logging.out_dir={tmp_path}", timeout=600)
    assert "iter 1: success" in out and (tmp_path / run_name / "final" / "model.safetensors").is_file()


def test_libero_preset_runs_the_ppo_recipe(tmp_path):
    """The LIBERO preset (objective=ppo, trainable=expert) through stage 11 on the real simulator: a tiny random pi0,
    one iteration of 2 Flow-SDE rollouts, on CPU."""
    out = _run("11_train_ript_vla_style.py", "--config_path", "libero_spatial", "device=cpu", "task.task_ids=[0]",
               "algo.iterations=1", "algo.num_groups=1", "algo.group_size=2", "algo.eval_every=0",
               "task.eval_states=0", "env.runner.num_envs=2", "env.runner.max_steps=10", "features.save_video=false",
               "features.enable_smart_sampling=false", "logging.progress=false", "logging.plot=false",
               f"logging.out_dir={tmp_path}", timeout=600)
    assert "iter 1: success 0.00 (2 rollouts)" in out, out[-2000:]
    from pi0.ript.config import load_config
    cfg = load_config(str(tmp_path / "libero_spatial" / "config.yaml"))
    assert (cfg.algo.objective, cfg.algo.trainable, cfg.task.env) == ("ppo", "expert", "libero")
    assert (tmp_path / "libero_spatial" / "final" / "model.safetensors").is_file()
