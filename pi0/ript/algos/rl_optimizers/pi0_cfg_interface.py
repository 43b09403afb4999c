"""Re-export of the seed's import path: the CFG objective lives in :mod:`pi0.ript.objectives`."""

from pi0.ript.objectives import CFGObjective as PI0_CFG_Adapter
from pi0.ript.objectives import Window, cfg_condition_inputs, env_to_model_actions, masked_flow_loss

__all__ = ["PI0_CFG_Adapter", "Window", "cfg_condition_inputs", "env_to_model_actions", "masked_flow_loss"]
