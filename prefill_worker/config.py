"""Configuration of one prefill worker process (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """How a prefill replica admits hand-offs, ships KV and exposes itself."""

    max_waiting_requests: int = 256
    """Prefills waiting for a batch slot beyond which new ones are refused."""
    num_threads: int | None = None
    """torch intra-op threads of the engine thread; None uses every core the process may run on."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to."""
    metrics_port: int = 0
    """Port of the Prometheus endpoint; 0 picks a free one."""
    kv_transport: str = "nixl"
    """How this worker writes KV into decode workers' pools."""

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: must be >= 0, got {self.max_waiting_requests}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is not a port")
        if self.kv_transport != "nixl":
            raise ValueError(f"kv_transport: {self.kv_transport!r} is not one of ('nixl',)")
