"""The router's view of the worker pools, and how it picks a replica.

The view is refreshed from the controller in the background; between refreshes the router
counts the requests it sent to each replica itself, so a burst does not all land on the replica
that looked idlest at the last refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_store.keys import KeyNamespace
from proto import splitserve_pb2 as pb
from router.routing.policy import WorkerLoad


@dataclass
class Replica:
    """A worker replica as one router sees it."""

    handle: object
    """The Ray actor handle."""
    model: pb.ModelInfo
    status: pb.ReplicaStatus
    num_inflight: int = 0
    """Requests this router has running on the replica right now."""
    namespace: KeyNamespace | None = None
    """Key namespace of the replica's blocks, fetched once (for cache-aware routing)."""

    @property
    def replica_id(self) -> str:
        return self.status.replica_id


@dataclass
class WorkerDirectory:
    """Replicas per pool, keyed by replica id."""

    replicas: dict[str, Replica] = field(default_factory=dict)

    def update(self, entries: list[tuple[pb.ReplicaStatus, pb.ModelInfo, object]]) -> None:
        """Replace the view with the controller's list, keeping this router's in-flight counts.
        A ``None`` handle means "the one you have" (the controller sends each handle once); an
        entry without a handle for a replica this view lacks is left out (the next refresh, which
        names only the replicas held, brings its handle)."""
        fresh = {}
        for status, model, handle in entries:
            old = self.replicas.get(status.replica_id)
            if handle is None:
                if old is None:
                    continue
                handle = old.handle
            replica = Replica(handle, model, status, old.num_inflight if old else 0, old.namespace if old else None)
            fresh[status.replica_id] = replica
        self.replicas = fresh

    def served_models(self) -> list[str]:
        """Models a healthy decode replica serves (prefill replicas alone serve nothing)."""
        return sorted({r.model.id for r in self.replicas.values() if r.status.healthy and r.status.pool == "decode"})

    def model_infos(self) -> list[pb.ModelInfo]:
        infos = {r.model.id: r.model for r in self.replicas.values() if r.status.healthy and r.status.pool == "decode"}
        return [infos[k] for k in sorted(infos)]

    def refuse_mismatched_namespaces(self) -> list[str]:
        """Mark unhealthy (in this router's view) every replica whose key namespace differs from
        the first known one of its model (TP shard fields aside): its blocks' keys would not be
        the router's. Returns one message per refused replica, naming each differing field."""
        reference: dict[str, Replica] = {}
        refused = []
        for replica in self.replicas.values():
            if replica.namespace is None:
                continue
            first = reference.setdefault(replica.model.id, replica)
            differing = {
                name: pair for name, pair in first.namespace.differences(replica.namespace).items() if name not in ("tp_size", "tp_rank")
            }
            if differing and replica.status.healthy:
                replica.status.healthy = False
                parts = ", ".join(f"{name}: {a!r} on {first.replica_id} vs {b!r}" for name, (a, b) in differing.items())
                refused.append(f"replica {replica.replica_id} refused: KV key namespace differs ({parts})")
        return refused

    def healthy(self, pool: str, model: str, exclude: set[str] = frozenset()) -> list[Replica]:
        """Healthy replicas of ``pool`` serving ``model`` (any model when empty) that take new
        requests (not draining), but not those in ``exclude``."""
        return [
            r for r in self.replicas.values()
            if r.status.pool == pool and r.status.healthy and not r.status.draining
            and (not model or r.model.id == model) and r.replica_id not in exclude
        ]

    def pick(self, pool: str, model: str, exclude: set[str] = frozenset()) -> Replica | None:
        """The least loaded healthy replica of ``pool`` serving ``model`` (any model when empty), not in ``exclude``."""
        candidates = self.healthy(pool, model, exclude)
        if not candidates:
            return None
        return min(candidates, key=_load)


def worker_load(replica: Replica) -> WorkerLoad:
    """What the routing policy knows of a replica's load."""
    s = replica.status
    used = 1 - s.num_free_kv_blocks / s.num_kv_blocks if s.num_kv_blocks else 1.0
    return WorkerLoad(
        replica.replica_id,
        queued_prefill_tokens=s.num_queued_prefill_tokens,
        num_queued_requests=s.num_waiting + s.num_running,
        decode_load=max(s.num_waiting + s.num_running, replica.num_inflight) + used,
    )


def _load(replica: Replica) -> tuple[float, str]:
    s = replica.status
    queued = max(s.num_waiting + s.num_running, replica.num_inflight)
    used = 1 - s.num_free_kv_blocks / s.num_kv_blocks if s.num_kv_blocks else 1.0
    return (queued + used, replica.replica_id)
