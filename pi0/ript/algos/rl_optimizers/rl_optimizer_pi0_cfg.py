"""Re-export of the seed's import path: the update step lives in :mod:`pi0.ript.update`."""

from pi0.ript.update import OptimizerConfig
from pi0.ript.update import PolicyUpdate as RLOptimizerPI0_CFG

__all__ = ["OptimizerConfig", "RLOptimizerPI0_CFG"]
