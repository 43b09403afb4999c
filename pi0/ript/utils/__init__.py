"""Training infrastructure of stages 7-11: distributed helpers, resumable checkpoints, the config-driven loop."""
