"""Evaluation: LIBERO success rates with videos and JSON (``libero_eval``) and debug sessions (``debug``)."""
