"""Policy server: our PyTorch pi0 / pi0-FAST behind openpi's websocket protocol, so openpi's own clients work unchanged.

Adds: serving. openpi's LIBERO example (examples/libero/main.py), its other example clients and robots that use
``openpi_client.websocket_client_policy.WebsocketClientPolicy`` connect to this server as to openpi's
``scripts/serve_policy.py``: msgpack-numpy frames, metadata on connect, ``infer(obs) -> {"actions": (H, 7),
"server_timing": ...}``, ``GET /healthz``, a traceback frame + close 1011 on an error. Observations use openpi's LIBERO
keys (observation/image, observation/wrist_image, observation/state, prompt); requests from several clients that
arrive while the model is busy run as one batch. Any converted or trained policy directory serves (config.json's
``model_type`` picks pi0 or pi0-FAST); a frame larger than ``--max_frame_bytes`` is refused.

    .venv/bin/python scripts/serve_policy.py                                   # tiny embedded default, port 8000
    .venv/bin/python scripts/serve_policy.py --checkpoint ckpts/pi0_libero --device cuda --port 8000
    .venv/bin/python scripts/serve_policy.py --checkpoint ckpts/pi0_libero --openpi_bf16_params  # openpi numerics
    .venv/bin/python scripts/serve_policy.py --checkpoint ckpts/pi0_fast_libero                 # pi0-FAST
(Single process; no torchrun: one model serves all clients.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pi0.errors import run_cli
from pi0.policies import load_policy
from pi0.policies.presets import tiny_policy
from pi0.serving.websocket_server import DEFAULT_MAX_FRAME_BYTES, LiberoServingPolicy, PolicyServer
from pi0.utils.cli import parse_config


@dataclass
class Config:
    """Server options."""

    checkpoint: str | None = None  # policy directory (pi0, pi0.5, pi0-FAST; ours, openpi-PyTorch, RLinf, LeRobot)
    # None = tiny embedded pi0 (random weights)
    tokenizer: str | None = None  # openpi-PyTorch / RLinf / LeRobot directories: PaliGemma's sentencepiece model
    norm_stats: str | None = None  # ... their norm_stats.json when the directory has none
    openpi_config: str | None = None  # ... the openpi TrainConfig preset (pi0.5 needs one; e.g. pi05_libero)
    host: str = "0.0.0.0"  # as openpi's server: all interfaces; use 127.0.0.1 to serve this machine only
    port: int = 8000
    device: str = "cpu"
    dtype: str | None = None  # "float32" | "bfloat16"; None = as saved
    openpi_bf16_params: bool = False  # pi0: round weights to bf16 as unmodified openpi serving does
    max_batch: int = 8  # most requests run in one model call
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # larger frames are refused (close 1009) before they are read
    seed: int = 0  # torch seed of the flow noise


def main(argv: list[str] | None = None) -> None:
    """Load (or build) the policy, then serve until interrupted."""
    cfg = parse_config(Config, argv, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.port < 0 or cfg.port > 65535:
        raise SystemExit(f"--port must be in 0..65535 (0 = any free port), got {cfg.port}")
    torch.manual_seed(cfg.seed)
    overrides = {"dtype": cfg.dtype} if cfg.dtype else {}
    if cfg.openpi_bf16_params:
        overrides["openpi_bf16_params"] = True
    if cfg.checkpoint:
        policy = load_policy(cfg.checkpoint, device=cfg.device, tokenizer=cfg.tokenizer, norm_stats=cfg.norm_stats,
                             openpi_config=cfg.openpi_config, **overrides)
    else:
        policy = tiny_policy(seed=cfg.seed, dtype=cfg.dtype or "float32").to(cfg.device)
    server = PolicyServer(LiberoServingPolicy(policy, name=cfg.checkpoint or "pi0-tiny-random"),
                          host=cfg.host, port=cfg.port, max_batch=cfg.max_batch, max_frame_bytes=cfg.max_frame_bytes)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logging.info("stopped")


if __name__ == "__main__":
    run_cli(main)
