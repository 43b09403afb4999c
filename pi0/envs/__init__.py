"""Gymnasium environments of the project and their conventions (:mod:`pi0.envs.conventions`).

Registering is cheap (entry points are strings; no simulator is imported).
"""

from gymnasium.envs.registration import register

from pi0.envs.conventions import (
    ARENA_GYM_ID,
    CAMERA_KEYS,
    LIBERO_GYM_IDS,
    LIBERO_SUITE_TABLE,
    LIBERO_SUITES,
    METAWORLD_GYM_ID,
    SUITE_MAX_STEPS,
    WAIT_ACTION,
    EnvSpec,
    libero_env_spec,
    make_env_spec,
    upright,
)

__all__ = ["ARENA_GYM_ID", "CAMERA_KEYS", "LIBERO_GYM_IDS", "LIBERO_SUITE_TABLE", "LIBERO_SUITES", "METAWORLD_GYM_ID",
           "SUITE_MAX_STEPS",
           "WAIT_ACTION", "EnvSpec", "libero_env_spec", "make_env_spec", "upright"]

# LIBERO suites (the env truncates itself at the suite's max steps, hence max_episode_steps=None).
for _suite, _row in LIBERO_SUITE_TABLE.items():
    register(id=_row.gym_id, entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": _suite},
             max_episode_steps=None, disable_env_checker=True)

# Arena: fast built-in language-conditioned tabletop task with LIBERO's observation keys (pi0/envs/arena/).
register(id=ARENA_GYM_ID, entry_point="pi0.envs.arena:ArenaEnv", max_episode_steps=None, disable_env_checker=True)
# The arena behind a simulated network API (latency per call): I/O-bound envs for the thread / asyncio backends.
register(id="arena-remote-v0", entry_point="pi0.envs.arena.remote:RemoteArenaEnv", max_episode_steps=None,
         disable_env_checker=True)
# MetaWorld MT10 with LIBERO's observation / action conventions (pi0/envs/metaworld_env.py; needs `metaworld`).
register(id=METAWORLD_GYM_ID, entry_point="pi0.envs.metaworld_env:MetaWorldEnv", max_episode_steps=None,
         disable_env_checker=True)
