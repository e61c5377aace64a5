"""Transports by name, imported only when asked for, so that importing kv_transfer never imports NIXL."""

from __future__ import annotations

import importlib

TRANSPORTS = {"nixl": "kv_transfer.nixl_transport:NixlTransport"}
"""Transport name -> ``module:class``."""


def transport_class(name: str) -> type:
    """The transport class registered as ``name``; ValueError naming the known ones otherwise."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport: {name!r} is not one of {sorted(TRANSPORTS)}")
    module_name, class_name = TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
