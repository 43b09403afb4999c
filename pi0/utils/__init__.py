"""Small shared utilities (video writing, ...)."""
