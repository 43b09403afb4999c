"""The network layer: SigLIP, Gemma, the PaliGemma + action-expert stack, pi0 and pi0-FAST, the fast sampler, and
the pure attention / flow functions. It imports nothing above it (no policy, conversion, serving or RL code)."""
