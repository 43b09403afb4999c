"""Public import path kept for users: ``pi0.modeling_pi0fast`` (the code lives in ``pi0.models.pi0fast`` and
``pi0.policies.pi0fast``)."""

from pi0.models.pi0fast import PALIGEMMA_EOS_TOKEN, PI0FASTModel, Pi0FASTConfig
from pi0.policies.pi0fast import FASTPolicyConfig, PI0FASTPolicy

__all__ = ["PALIGEMMA_EOS_TOKEN", "FASTPolicyConfig", "PI0FASTModel", "PI0FASTPolicy", "Pi0FASTConfig"]
