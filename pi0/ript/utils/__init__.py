"""Training infrastructure of stages 9-11: distributed helpers, resumable checkpoints, the config-driven loop."""
