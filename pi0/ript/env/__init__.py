"""RIPT env runners: ``make_runner(config, policy, env_factory)`` -> LIBEROEnvRunner or PI0LiberoRunner (RIPT-VLA)."""

from pi0.ript.env.factory import make_runner

__all__ = ["make_runner"]
