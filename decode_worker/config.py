"""Configuration of one worker process (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import WorkerProcessConfig
from proto.tls import ClusterTLSConfig

REMOTE_PREFILL_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class WorkerConfig(WorkerProcessConfig):
    """How a decode replica admits requests, receives remote KV and exposes itself."""

    kv_transport: str = "nixl"
    """How prefill workers write KV into this worker's pool: "nixl", or "none" (aggregated only)."""
    kv_transfer_timeout_s: float = 30.0
    """Seconds a remote prefill may take, from the ask to the KV in the pool, before the failure policy applies."""
    remote_prefill_failure: str = "recompute"
    """When a remote prefill fails or times out: "recompute" (prefill here) or "fail" (end the request with an error)."""
    max_local_prefill_tokens: int = 0
    """Prefill here, not remotely, when at most this many prompt tokens are missing from this pool."""
    request_plane_host: str = ""
    """Address the request plane (routers' Generate traffic) listens on; empty: the node address Ray uses."""
    request_plane_port: int = 0
    """Its TCP port; 0: any free one (routers learn it over Ray)."""
    cluster_tls: ClusterTLSConfig | None = None
    """Mutual TLS on the request plane: only routers with a cluster-CA certificate connect; None: plain TCP."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_transport not in ("nixl", "none"):
            raise ValueError(f"kv_transport: {self.kv_transport!r} is not one of ('nixl', 'none')")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s: must be > 0, got {self.kv_transfer_timeout_s}")
        if self.remote_prefill_failure not in REMOTE_PREFILL_FAILURE_POLICIES:
            raise ValueError(
                f"remote_prefill_failure: {self.remote_prefill_failure!r} is not one of {REMOTE_PREFILL_FAILURE_POLICIES}"
            )
        if not 0 <= self.request_plane_port <= 65535:
            raise ValueError(f"request_plane_port: must be in [0, 65535], got {self.request_plane_port}")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens: must be >= 0, got {self.max_local_prefill_tokens}")
