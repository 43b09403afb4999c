"""Re-export: checkpoint / resume lives in :mod:`pi0.ript.checkpoint`."""

from pi0.ript.checkpoint import latest_checkpoint, load_train_state, save_checkpoint

__all__ = ["latest_checkpoint", "load_train_state", "save_checkpoint"]
