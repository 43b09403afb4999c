"""Policies: a model + normalization + tokenizer + I/O, with one directory format per model type.

``load_policy(dir)`` loads any converted or trained directory (``config.json``'s ``model_type`` picks
``pi0.policies.pi0.PI0Policy`` or ``pi0.policies.pi0fast.PI0FASTPolicy``) and openpi-PyTorch / RLinf / LeRobot pi0 and
pi0.5 directories as they are (``pi0.conversion.openpi_pytorch``); ``pi0.policies.libero`` is openpi's
LIBERO I/O for every model type; ``pi0.policies.presets`` the tiny embedded defaults.
"""

from pi0.policies.loading import MODEL_TYPES, load_policy, model_type_of

__all__ = ["MODEL_TYPES", "load_policy", "model_type_of"]
