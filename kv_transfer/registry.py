"""Transports by name, imported only when asked for, so that importing kv_transfer never imports NIXL."""

from __future__ import annotations

import importlib
import uuid
from dataclasses import replace
from typing import Any

from kv_store.keys import KeyNamespace
from kv_transfer.protocol import KVEndpoint

TRANSPORTS = {"nixl": "kv_transfer.nixl_transport:NixlTransport"}
"""Transport name -> ``module:class``."""


def transport_class(name: str) -> type:
    """The transport class registered as ``name``; ValueError naming the known ones otherwise."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport: {name!r} is not one of {sorted(TRANSPORTS)}")
    module_name, class_name = TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def open_endpoint(
    transport_name: str, replica_id: str, pool: Any, heads: range, namespace: KeyNamespace, rank: int = 0, layers: range | None = None, num_model_layers: int = 0
) -> tuple[Any, KVEndpoint]:
    """Register a worker rank's KV pool with a transport agent of its own: ``(transport, endpoint)``.

    ``pool`` is the engine's paged KV cache (its ``buffer``, ``layout`` and ``num_blocks``) and
    ``heads`` the model's KV heads its blocks hold. The agent name is unique per process: a
    replica id can come back (a new cluster in the same Ray session), and a peer that cached the
    old agent's pool address must never write into the new one. ``namespace`` is the replica's;
    a rank of a tensor-parallel replica advertises its own rank in it. ``layers``: the model's
    layers the blocks hold, of ``num_model_layers`` (a pipeline stage's; None: all of them).
    """
    suffix = f"rank{rank}-" if rank else ""
    agent_name = f"{replica_id}-{suffix}{uuid.uuid4().hex[:8]}"
    transport = transport_class(transport_name)(agent_name, pool.buffer)
    endpoint = KVEndpoint(
        agent_name=agent_name,
        transport_metadata=transport.metadata(),
        namespace=replace(namespace, tp_rank=rank) if namespace.tp_size > 1 else namespace,
        layout=pool.layout,
        num_blocks=pool.num_blocks,
        head_start=heads.start,
        head_end=heads.stop,
        layer_start=layers.start if layers is not None else 0,
        num_model_layers=num_model_layers,
    )
    return transport, endpoint
