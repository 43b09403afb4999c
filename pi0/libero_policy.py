"""Public import path kept for users: ``pi0.libero_policy.predict_libero_action_chunk`` (the code lives in
``pi0.policies.libero``)."""

from pi0.policies.libero import (
    Pi0ChunkPolicy,
    construct_libero_observation,
    libero_policy_observation,
    predict_libero_action_chunk,
)

__all__ = ["Pi0ChunkPolicy", "construct_libero_observation", "libero_policy_observation",
           "predict_libero_action_chunk"]
