"""The layout's small pure parts: env conventions, runner config and presets, the schedulers, import direction."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym
import pytest

from pi0.envs import LIBERO_SUITE_TABLE, SUITE_MAX_STEPS, EnvSpec, libero_env_spec, make_env_spec
from pi0.rollout import (
    GreedyScheduler,
    GroupedScheduler,
    RandomChunkPolicy,
    RolloutRunner,
    RunnerConfig,
    libero_runner_config,
    make_requests,
    ript_vla_runner_config,
)

ROOT = Path(__file__).resolve().parents[1]


def test_env_specs_and_suite_table():
    assert make_env_spec("arena", task_id=2) == EnvSpec("arena-v0", {"task_id": 2, "render_on_demand": True})
    assert libero_env_spec("libero_10", task_id=3, resolution=64) == EnvSpec(
        "libero-10-v0", {"task_id": 3, "render_on_demand": True, "resolution": 64})
    with pytest.raises(ValueError, match="libero_spatial, libero_object"):
        libero_env_spec("libero_100")
    with pytest.raises(ValueError, match="'libero', 'arena' or 'metaworld'"):
        make_env_spec("mujoco")
    assert SUITE_MAX_STEPS == {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                               "libero_90": 400}
    for suite, row in LIBERO_SUITE_TABLE.items():  # every suite is registered under its gym id
        assert gym.spec(row.gym_id).kwargs == {"suite": suite}


def test_runner_config_presets_and_validation():
    lib = libero_runner_config()
    assert (lib.num_envs, lib.replan_steps, lib.schedule, lib.group_size, lib.step_timeout) == (4, 5, "greedy", 1, 300.0)
    vla = ript_vla_runner_config(num_groups=3, group_size=2)
    assert (vla.num_envs, vla.group_size, vla.schedule) == (6, 2, "grouped")
    assert ript_vla_runner_config().num_envs == 8 and lib.replace(num_envs=2).num_envs == 2
    assert RunnerConfig(settle_action=[0, 1]).settle_action == (0.0, 1.0)
    with pytest.raises(ValueError, match="schedule"):
        RunnerConfig(schedule="random")
    with pytest.raises(ValueError, match="in_process"):
        RunnerConfig(in_process="gevent")
    with pytest.raises(ValueError, match="num_envs"):
        lib.replace(num_envs=0)
    with pytest.raises(TypeError, match="RunnerConfig"):
        RolloutRunner("arena-v0", RandomChunkPolicy(), {"num_envs": 2})


def test_greedy_scheduler_prefers_the_workers_task_and_requeues_at_the_front():
    reqs = make_requests([(0, 0), (1, 0), (0, 1), (1, 1)])
    s = GreedyScheduler(reqs, num_workers=2, task_affinity=True)
    got = list(s.assignments([0, 1], lambda w: True, [1, None]))
    assert [(w, r.index) for w, r in got] == [(0, 1), (1, 0)]  # worker 0 has task 1: it skips ahead to request 1
    s.requeue(got[0][1])
    assert [r.index for r in s.queue] == [1, 2, 3]
    plain = GreedyScheduler(reqs, num_workers=2, task_affinity=False)
    assert [r.index for _, r in plain.assignments([0, 1], lambda w: True, [1, 1])] == [0, 1]
    assert [r.index for _, r in plain.assignments([0, 1], lambda w: w == 1, [1, 1])] == [2]


def test_grouped_scheduler_fills_whole_blocks_only():
    reqs = make_requests([(0, 0), (1, 0), (2, 0)], group_size=2)
    s = GroupedScheduler(reqs, num_workers=5, group_size=2)  # 2 blocks; worker 4 is never used
    got = [(w, r.index) for w, r in s.assignments(range(5), lambda w: w != 3, [None] * 5)]
    assert got == [(0, 0), (1, 1)]  # block 1 has a busy worker (3): it waits
    assert [(w, r.index) for w, r in s.assignments([3], lambda w: True, [None] * 5)] == [(2, 2), (3, 3)]
    assert s.pending and not list(s.assignments([4], lambda w: True, [None] * 5))
    with pytest.raises(ValueError, match="num_envs >= group_size"):
        GroupedScheduler(reqs, num_workers=1, group_size=2)


def test_imports_flow_one_way():
    """Nothing outside pi0/ript (and its tests) imports pi0.ript; envs never import the rollout engine."""
    pattern = re.compile(r"^\s*(from|import) pi0\.(\w+)", re.M)
    for path in [*ROOT.glob("*.py"), *(ROOT / "pi0").rglob("*.py"), *(ROOT / "scripts").glob("*.py"),
                 *(ROOT / "bench").glob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        used = {m.group(2) for m in pattern.finditer(path.read_text())}
        rl_entry = re.match(r"(7|8|9|10|11)_\w+\.py$", rel) or rel in ("quick_single_gpu_test.py",
                                                                         "bench/rl_improvement.py",
                                                                         "bench/rl_drift.py",
                                                                         "bench/rl_throughput.py",
                                                                         "bench/sde_gap.py",
                                                                         "bench/train_memory.py",
                                                                         "bench/parallel_start.py",
                                                                         "bench/start_cooldown.py",
                                                                         "bench/make_run_tune.py")
        if not rel.startswith("pi0/ript/") and not rl_entry:  # the RL stages / tools are pi0.ript's entry points
            assert "ript" not in used, rel
        if rel.startswith("pi0/envs/"):
            assert not used & {"rollout", "ript", "eval"}, rel
        if rel.startswith("pi0/rollout/"):
            assert not used & {"ript", "evaluation", "models", "policies", "modeling_pi0", "libero_policy"}, rel
        lazy = LAZY_EDGES.get(rel, set())
        for top in lazy:  # the allowed exceptions are function-local imports only
            assert not re.search(rf"^(from|import) pi0\.{top}\b", path.read_text(), re.M), f"{rel}: top-level {top}"
        for layer, forbidden in LAYER_RULES.items():
            if rel.startswith(f"pi0/{layer}/"):
                assert not (used - lazy) & forbidden, f"{rel} imports {sorted((used - lazy) & forbidden)}"


# What each layer must not import (first component after ``pi0.``): the model layer is the bottom; policies sit on
# it; conversion and serving sit above policies; nothing but the RL entry points imports ript (checked above).
SHIMS = {"modeling_pi0", "modeling_pi0fast", "libero_policy"}  # public re-export paths, for users only
# The policy layer's loaders read foreign checkpoint layouts (openpi-PyTorch, RLinf, LeRobot) through
# pi0.conversion (foreign_files, openpi_pytorch), imported inside the loading functions only: conversion builds policies and imports
# the policy layer at module level, so a function-local import is what keeps the module graph acyclic.
LAZY_EDGES = {"pi0/policies/pi0.py": {"conversion"}, "pi0/policies/loading.py": {"conversion"}}

LAYER_RULES = {
    "models": {"policies", "conversion", "serving", "evaluation", "rollout", "envs", "ript", "utils", *SHIMS},
    "policies": {"conversion", "serving", "evaluation", "ript", "envs", *SHIMS},
    "conversion": {"serving", "evaluation", "rollout", "envs", "ript", *SHIMS},
    "serving": {"conversion", "evaluation", "envs", "ript", *SHIMS},
    "evaluation": {"conversion", "serving", "ript", *SHIMS},
}


def _module_imports(path: Path) -> set[str]:
    """pi0 modules a file imports at module level (``from pi0.a.b import c`` -> pi0.a.b or pi0.a.b.c)."""
    import ast

    out = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pi0"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("pi0")]
        for name in names:
            rel = Path(*name.split("."))
            if (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file():
                out.add(name)
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_no_import_cycle_in_the_package():
    """Module-level imports of pi0 (a package's __init__ counts as imported with it) form no cycle."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "pi0").rglob("*.py"):
        mod = _module_name(path)
        deps = _module_imports(path)
        parents = {".".join(d.split(".")[:i]) for d in deps for i in range(2, d.count(".") + 1)}
        own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 2)}  # its own packages run first
        graph[mod] = (deps | parents) - own
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(d):] + [m, d])}")
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_layer_rule_catches_a_model_importing_a_policy(tmp_path):
    """The rule is live: a model-layer file that imports a policy is flagged."""
    bad = "from pi0.policies.pi0 import PI0Policy\n"
    used = {m.group(2) for m in re.finditer(r"^\s*(from|import) pi0\.(\w+)", bad, re.M)}
    assert used & LAYER_RULES["models"] == {"policies"}


def test_public_import_paths():
    from pi0.libero_policy import predict_libero_action_chunk
    from pi0.modeling_pi0 import PI0Policy
    from pi0.modeling_pi0fast import PI0FASTModel, PI0FASTPolicy
    from pi0.policies import load_policy
    from pi0.ript.algos.rl_optimizers.file_counter import FileGlobalCounter
    from pi0.ript.reward_function import BinarySuccessReward

    assert PI0Policy.__module__ == "pi0.policies.pi0" and PI0FASTPolicy.__module__ == "pi0.policies.pi0fast"
    assert PI0FASTModel.__module__ == "pi0.models.pi0fast" and callable(load_policy)
    assert predict_libero_action_chunk.__module__ == "pi0.policies.libero"
    assert FileGlobalCounter and BinarySuccessReward
