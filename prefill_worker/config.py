"""Configuration of one prefill worker process (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import WorkerProcessConfig


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerProcessConfig):
    """How a prefill replica admits hand-offs, ships KV and exposes itself."""

    kv_transport: str = "nixl"
    """How this worker writes KV into decode workers' pools."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_transport != "nixl":
            raise ValueError(f"kv_transport: {self.kv_transport!r} is not one of ('nixl',)")
