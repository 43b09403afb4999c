"""Serving: any policy behind openpi's websocket protocol (``websocket_server``), so openpi's clients work unchanged."""

from pi0.serving.websocket_server import LiberoServingPolicy, PolicyServer

__all__ = ["LiberoServingPolicy", "PolicyServer"]
