"""Gymnasium environments of the project; registering is cheap (entry points are strings, nothing is imported)."""

from gymnasium.envs.registration import register

# LIBERO suites (the env truncates itself at the suite's max steps, hence max_episode_steps=None).
register(id="libero-spatial-v0", entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": "libero_spatial"},
         max_episode_steps=None, disable_env_checker=True)
register(id="libero-object-v0", entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": "libero_object"},
         max_episode_steps=None, disable_env_checker=True)
register(id="libero-goal-v0", entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": "libero_goal"},
         max_episode_steps=None, disable_env_checker=True)
register(id="libero-10-v0", entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": "libero_10"},
         max_episode_steps=None, disable_env_checker=True)
register(id="libero-90-v0", entry_point="pi0.envs.libero_env:LiberoEnv", kwargs={"suite": "libero_90"},
         max_episode_steps=None, disable_env_checker=True)

# Arena: fast built-in language-conditioned tabletop task with LIBERO's observation keys (pi0/envs/arena.py).
register(id="arena-v0", entry_point="pi0.envs.arena:ArenaEnv", max_episode_steps=None, disable_env_checker=True)
