"""Public import path kept for users: ``pi0.modeling_pi0.PI0Policy`` (the code lives in ``pi0.models.pi0`` and
``pi0.policies.pi0``)."""

from pi0.models.pi0 import PI0Model, param_storage_dtype
from pi0.policies.io import Observation
from pi0.policies.pi0 import PI0Policy, PolicyConfig, default_norm_stats

__all__ = ["Observation", "PI0Model", "PI0Policy", "PolicyConfig", "default_norm_stats", "param_storage_dtype"]
