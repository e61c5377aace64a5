"""What a restarted controller cannot observe, kept in Ray's internal KV (the GCS).

The controller rebuilds its map from the live actors in the namespace (router/control/controller.py),
but a few facts live nowhere else: the generation that fences an older controller, each pool's
spec and target, which replicas finished joining (a live actor without a record was half
started and is rolled back), which ones are draining and until when, the nodes being drained, the routers to keep alive,
and the highest replica id handed out (ids are never reused). They are written here before or
as each act happens, so a controller killed between any two lines finds them.

Why the GCS's KV and not a detached "state" actor: it is already there, it outlives every actor
(and, with GCS fault tolerance on Redis, a head restart), and it is not one more process that
can die. Values are pickled: specs hold the workers' config dataclasses.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

from ray.experimental import internal_kv

KV_NAMESPACE = "splitserve-controller"
"""The internal-KV namespace of the controller's keys."""


@dataclass(frozen=True)
class ReplicaRecord:
    """A replica that joined the map, as a restarted controller needs to find it again."""

    replica_id: str
    pool: str
    node_id: str
    started_unix_s: float
    """Wall-clock time it joined (a restarted controller judges "died young" by it)."""
    draining: bool = False
    drain_deadline_unix_s: float = 0.0
    """Wall-clock time after which a draining replica is removed even if busy."""


@dataclass(frozen=True)
class ControllerHistory:
    """The controller's own restarts, for ``status`` and metrics."""

    generation: int
    """Incremented at every (re)start; the newest controller's generation is the stored one."""
    num_restarts: int
    """Times Ray restarted the controller after it died."""
    last_restart_unix_s: float
    """When the last restart happened (0 when never)."""


class ControllerStore:
    """Typed reads and writes of the controller's keys. Each call is one GCS round trip; blocking,
    so async callers run them off the event loop."""

    def __init__(self, kv_namespace: str = KV_NAMESPACE) -> None:
        self.kv_namespace = kv_namespace

    def _get(self, key: str):
        value = internal_kv._internal_kv_get(key.encode(), namespace=self.kv_namespace)
        return None if value is None else pickle.loads(value)

    def _put(self, key: str, value) -> None:
        internal_kv._internal_kv_put(key.encode(), pickle.dumps(value), overwrite=True, namespace=self.kv_namespace)

    def _delete(self, key: str) -> None:
        internal_kv._internal_kv_del(key.encode(), namespace=self.kv_namespace)

    def _keys(self, prefix: str) -> list[str]:
        return sorted(k.decode() for k in internal_kv._internal_kv_list(prefix.encode(), namespace=self.kv_namespace))

    def begin_generation(self, restarted: bool, keep_cluster: bool = False) -> ControllerHistory:
        """Take the next generation. A restart (``restarted``: Ray restarted this actor), or a new
        controller told to ``keep_cluster`` that finds one (a Kubernetes head that came back with
        its GCS kept on Redis), goes on with the last cluster and is counted as a restart; any
        other start forgets the last cluster's pools, replicas and routers. The generation always
        counts up."""
        old = self.history()
        if restarted or keep_cluster:
            restarted = restarted or bool(self._keys("pool/") or self._keys("router/"))  # a cluster was started
        else:
            for key in self._cluster_keys():
                self._delete(key)
        history = ControllerHistory(old.generation + 1, old.num_restarts + 1 if restarted else 0, time.time() if restarted else 0.0)
        self._put("history", history)
        return history

    def _cluster_keys(self) -> list[str]:
        return [k for prefix in ("pool/", "replica/", "router/", "next_id/", "draining_node/") for k in self._keys(prefix)]

    def history(self) -> ControllerHistory:
        return self._get("history") or ControllerHistory(0, 0, 0.0)

    def generation(self) -> int:
        """The newest controller's generation (0 before any)."""
        return self.history().generation

    def save_pool(self, pool: str, spec, target: int) -> None:
        self._put(f"pool/{pool}", (spec, target))

    def pools(self) -> dict[str, tuple[object, int]]:
        """Pool -> (spec, target) of every pool ever sized."""
        return {key.removeprefix("pool/"): self._get(key) for key in self._keys("pool/")}

    def save_replica(self, record: ReplicaRecord) -> None:
        self._put(f"replica/{record.replica_id}", record)

    def forget_replica(self, replica_id: str) -> None:
        self._delete(f"replica/{replica_id}")

    def replicas(self) -> dict[str, ReplicaRecord]:
        return {r.replica_id: r for r in (self._get(key) for key in self._keys("replica/")) if r is not None}

    def save_router(self, spec, status) -> None:
        """A router to keep alive, with its last status (its address)."""
        self._put(f"router/{spec.router_id}", (spec, status))

    def forget_router(self, router_id: str) -> None:
        self._delete(f"router/{router_id}")

    def routers(self) -> dict[str, tuple[object, object]]:
        """Router id -> (spec, last status)."""
        return {key.removeprefix("router/"): self._get(key) for key in self._keys("router/")}

    def save_draining_node(self, node_id: str, timeout_s: float) -> None:
        """A Ray node being drained (its slots count for no pool), with its drain's timeout."""
        self._put(f"draining_node/{node_id}", timeout_s)

    def forget_draining_node(self, node_id: str) -> None:
        self._delete(f"draining_node/{node_id}")

    def draining_nodes(self) -> dict[str, float]:
        """Node id -> drain timeout of the nodes being drained."""
        return {key.removeprefix("draining_node/"): self._get(key) for key in self._keys("draining_node/")}

    def reserve_id(self, pool: str, at_least: int) -> int:
        """The next replica index of ``pool`` (never one handed out before, nor below ``at_least``)."""
        index = max(self._get(f"next_id/{pool}") or 0, at_least)
        self._put(f"next_id/{pool}", index + 1)
        return index

    def clear(self) -> None:
        """Forget the cluster (its controller shut down for good); the generation stays."""
        for key in self._cluster_keys():
            self._delete(key)
