"""``make_runner(cfg, ...)``: pick the rollout runner configuration from the RL config.

``cfg.features.use_ript_vla_runner`` selects :class:`PI0LiberoRunner` (grouped envs, RIPT-VLA style)
or :class:`LIBEROEnvRunner` (greedy). Keys read (all optional; dicts, OmegaConf configs or
attribute objects work):

* ``env.id`` + ``env.kwargs``: gym id and kwargs of the env (e.g. ``arena-v0``); otherwise
  ``env.suite`` (``libero_spatial`` ...) + ``env.kwargs`` builds a LIBERO EnvSpec.
* ``rollout.<field>`` for every :class:`pi0.rollout.runner.RunnerConfig` field, plus the aliases
  ``rollout.num_parallel_envs`` -> ``num_envs`` and ``rollout.rloo_batch_size`` -> ``group_size``;
  ``rollout.num_groups`` for the RIPT-VLA runner.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pi0.rollout.runner import RolloutRunner, RunnerConfig
from pi0.rollout.types import ChunkPolicy
from pi0.rollout.vec_env import EnvFactory, EnvSpec

__all__ = ["make_runner", "cfg_get"]

_ALIASES = {"num_parallel_envs": "num_envs", "rloo_batch_size": "group_size"}
_MISSING = object()


def cfg_get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b`` for dicts, OmegaConf configs and plain objects; ``default`` if any part is missing."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node[part] if (hasattr(node, "keys") and part in node) else getattr(node, part, _MISSING)
        except Exception:  # noqa: BLE001 - e.g. OmegaConf missing values
            return default
        if node is _MISSING:
            return default
    return default if node is None else node


def _plain(value: Any) -> Any:
    """Convert OmegaConf containers to plain Python (without importing omegaconf eagerly)."""
    if hasattr(value, "_content") or type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _env_factory_from_cfg(cfg: Any) -> EnvFactory | None:
    """EnvSpec from ``cfg.env`` (None if the config does not describe an env)."""
    kwargs = dict(_plain(cfg_get(cfg, "env.kwargs", {})) or {})
    env_id = cfg_get(cfg, "env.id")
    if env_id:
        return EnvSpec(str(env_id), kwargs)
    suite = cfg_get(cfg, "env.suite")
    if suite:
        from pi0.ript.env.pi0_libero_runner import libero_env_spec

        return libero_env_spec(str(suite), **kwargs)
    return None


def make_runner(cfg: Any, policy: ChunkPolicy | None = None, env_factory: EnvFactory | None = None,
                **overrides: Any) -> RolloutRunner:
    """Build the runner chosen by ``cfg.features.use_ript_vla_runner`` (keyword ``overrides`` win)."""
    from pi0.ript.env.pi0_libero_runner import LIBEROEnvRunner
    from pi0.ript.env.pi0_libero_runner_ript_vla import PI0LiberoRunner

    use_ript_vla = bool(cfg_get(cfg, "features.use_ript_vla_runner", False))
    cls = PI0LiberoRunner if use_ript_vla else LIBEROEnvRunner
    settings: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(RunnerConfig)}
    rollout = _plain(cfg_get(cfg, "rollout", {})) or {}
    if not isinstance(rollout, dict):
        rollout = {k: getattr(rollout, k) for k in dir(rollout) if not k.startswith("_")}
    for key, value in rollout.items():
        name = _ALIASES.get(key, key)
        if name in fields:
            settings[name] = tuple(value) if name == "settle_action" else value
    if use_ript_vla and rollout.get("num_groups") is not None:
        settings["num_groups"] = int(rollout["num_groups"])
    settings.update(overrides)
    factory = env_factory or _env_factory_from_cfg(cfg)
    return cls(factory, policy, **settings)
