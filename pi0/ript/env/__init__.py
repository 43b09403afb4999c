"""RIPT env runners: ``make_runner(cfg, policy)`` picks LIBEROEnvRunner or PI0LiberoRunner (RIPT-VLA)."""

from pi0.ript.env.factory import cfg_get, make_runner

__all__ = ["cfg_get", "make_runner"]
