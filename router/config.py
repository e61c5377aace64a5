"""Router configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proto.tls import ClusterTLSConfig

CONTROLLER_NAME = "splitserve-controller"
"""The detached ClusterController's Ray actor name (in ``NAMESPACE``)."""
NAMESPACE = "splitserve"
"""The Ray namespace of every splitserve actor."""
POLICIES = ("splitserve", "round_robin", "least_loaded", "sglang_cache_aware")
"""The routing policies ``RouterConfig.routing_policy`` may name (router.routing.policy builds them)."""


@dataclass(frozen=True)
class TLSConfig:
    """Server-side TLS; with ``client_ca_file`` set, clients must present a certificate it signed."""

    cert_file: Path
    """PEM server certificate chain."""
    key_file: Path
    """PEM private key of the server certificate."""
    client_ca_file: Path | None = None
    """PEM CA bundle for mutual TLS; None accepts any client."""

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a file")


@dataclass(frozen=True)
class RouterConfig:
    """One router replica: where it listens, whom it lets in, how much it admits."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds to."""
    port: int = 50051
    """gRPC port (splitserve's API and KServe v2 / Triton's GRPCInferenceService); 0 picks a free one."""
    http_port: int | None = None
    """Port of the OpenAI-compatible and KServe v2 HTTP API on ``host``; 0 picks a free one; None serves no HTTP."""
    tls: TLSConfig | None = None
    """TLS settings; None serves plaintext."""
    cluster_tls: ClusterTLSConfig | None = None
    """Mutual TLS to the decode workers' request plane (set it on the workers too); None: plain TCP."""
    token_file: Path | None = None
    """File holding the bearer token every call must carry; None disables token auth."""
    max_inflight_requests: int = 512
    """Generate calls in flight on this router beyond which new ones get RESOURCE_EXHAUSTED."""
    max_prompt_chars: int = 1_000_000
    """Longest text prompt (or chat messages, summed) accepted."""
    max_prompt_token_ids: int = 262_144
    """Most prompt token ids accepted."""
    worker_refresh_interval_s: float = 2.0
    """How often the router refreshes its view of the worker pools from the controller."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus endpoint."""
    metrics_port: int = 0
    """Port of the Prometheus endpoint; 0 picks a free one."""
    routing_policy: str = "splitserve"
    """How prefill workers are chosen: splitserve (cache- and load-aware), round_robin, least_loaded or sglang_cache_aware."""
    kv_event_poll_interval_s: float = 0.1
    """How often the router pulls each worker's KV events into its prefix index."""
    local_prefill_max_tokens: int = 0
    """Let the decode worker prefill a prompt when it lacks at most this many of its tokens (0: never)."""
    routing_memory_s: float = 2.0
    """How long the splitserve policy counts its own recent decisions as cached blocks (until KV events tell)."""
    max_n: int = 16
    """Most samples one request may ask for (``n``); each is an answer of its own on the decode replica of sample 0."""
    max_migrations: int = 3
    """Times one Generate call moves to another decode replica when the one serving it dies; 0 ends it with UNAVAILABLE."""
    migration_wait_s: float = 60.0
    """How long a migrating call waits for a live decode replica (e.g. the dead one's replacement)."""
    tokenizer_threads: int = 2
    """Threads that turn prompts into token ids in this router (off its event loop)."""

    def __post_init__(self) -> None:
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy: {self.routing_policy!r} is not one of {POLICIES}")
        if self.kv_event_poll_interval_s <= 0:
            raise ValueError(f"kv_event_poll_interval_s: must be > 0, got {self.kv_event_poll_interval_s}")
        if self.routing_memory_s < 0:
            raise ValueError(f"routing_memory_s: must be >= 0, got {self.routing_memory_s}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens: must be >= 0, got {self.local_prefill_max_tokens}")
        for name in ("port", "metrics_port", "http_port"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: {getattr(self, name)} is not a port")
        for name in ("max_inflight_requests", "max_prompt_chars", "max_prompt_token_ids", "tokenizer_threads", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {self.max_migrations}")
        if self.migration_wait_s < 0:
            raise ValueError(f"migration_wait_s: must be >= 0, got {self.migration_wait_s}")
        if self.worker_refresh_interval_s <= 0:
            raise ValueError(f"worker_refresh_interval_s: must be > 0, got {self.worker_refresh_interval_s}")
        if self.token_file is not None and not Path(self.token_file).is_file():
            raise ValueError(f"token_file: {self.token_file} is not a file")
