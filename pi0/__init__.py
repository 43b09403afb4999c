"""pi0 / pi0-FAST in PyTorch: exact openpi ports, LIBERO evaluation and RIPT-style RL fine-tuning."""

__version__ = "0.1.0"
