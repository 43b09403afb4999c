"""CI guard for the pinned MuJoCo: the settle phase of libero_10 task 0 must behave as under openpi's mujoco 3.2.3.

In init state 0 of libero_10 task 0 the ketchup bottle starts slightly inside its support and MuJoCo pushes it out.
Under 3.2.3 (openpi's stack) it rises to ~0.63 m and has settled by the first policy decision; under mujoco 3.17 it
is launched to ~1.1 m and is still in mid-air when the policy takes its first image. The env is created exactly as
openpi's examples/libero/main.py does (OffScreenRenderEnv, env.seed(7), reset, set_init_state, 10 wait steps).
"""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.libero

MAX_OBJECT_HEIGHT_M = 0.7  # 3.2.3 peaks at 0.63 m (ketchup), 3.17 at 1.14 m
NUM_WAIT_STEPS = 10  # as in openpi examples/libero/main.py: num_steps_wait


def test_libero_10_task0_objects_stay_below_0p7m_while_settling():
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    suite = benchmark.get_benchmark_dict()["libero_10"]()
    task = suite.get_task(0)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    # Cameras off: rendering does not touch the physics and costs ~140 ms per camera per step.
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=256, camera_widths=256, use_camera_obs=False)
    try:
        np.random.seed(7)
        env.seed(7)
        env.reset()
        env.set_init_state(suite.get_task_init_states(0)[0])
        inner = env.env
        body_ids = {name: inner.obj_body_id[name] for name in inner.objects_dict}
        assert "ketchup_1" in body_ids, sorted(body_ids)
        peak = {name: -np.inf for name in body_ids}
        for _ in range(NUM_WAIT_STEPS):
            env.step([0.0] * 6 + [-1.0])
            for name, bid in body_ids.items():
                peak[name] = max(peak[name], float(inner.sim.data.body_xpos[bid][2]))
    finally:
        env.close()
    too_high = {name: round(z, 3) for name, z in peak.items() if z > MAX_OBJECT_HEIGHT_M}
    import mujoco

    assert not too_high, (
        f"objects launched above {MAX_OBJECT_HEIGHT_M} m while settling under mujoco {mujoco.__version__}: {too_high}; "
        "openpi's physics is mujoco 3.2.3 (pinned in requirements.lock): reinstall with `make install`"
    )
    assert peak["ketchup_1"] > 0.55  # the push-out still happens (3.2.3: 0.63 m): the probe sees the real motion
