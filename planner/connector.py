"""How the planner acts on a cluster: the one interface between its decisions and the world.

A connector reports each pool's replicas (ready and starting) and sets a pool's target. The
planner never talks to Ray or Kubernetes itself; the same planner code drives the local Ray
cluster (``planner/connectors/ray.py``), a KubeRay RayCluster (``planner/connectors/kubernetes.py``)
and the trace-replay simulator (``bench/planner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolReplicas:
    """One pool as the connector sees it now."""

    pool: str
    target: int
    """Replicas the pool is being kept at."""
    ready: int
    """Replicas that are warm: they answered a health probe or served a request."""
    starting: int = 0
    """Replicas asked for and not yet ready."""
    draining: int = 0
    """Replicas being removed: they take no new requests and finish the ones they have."""


class ConnectorError(RuntimeError):
    """The cluster refused or failed an action (an API error, an actor that could not start);
    the planner logs and counts it, and retries with backoff."""


class Connector(Protocol):
    async def pools(self) -> dict[str, PoolReplicas]:
        """Every pool's replicas, by pool name (``POOLS``)."""
        ...

    async def set_replicas(self, pool: str, target: int) -> None:
        """Grow or shrink ``pool`` to ``target`` replicas; shrinking drains before removing.
        Raises ConnectorError when the cluster refuses."""
        ...
