"""Prometheus metrics of a router replica, each labelled with the router's id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60, 120)
"""The same buckets as engine/metrics.py's, so router and worker series line up; a copy because the
router may not import engine code beyond its config (tests/unit/test_layering.py)."""

PROMPT_LENGTH_BUCKETS = tuple(float(2 ** (k / 2)) for k in range(14, 37)) + (float("inf"),)
"""Upper bounds (tokens) of the prompt-length histogram, a factor of sqrt(2) apart from 128 to 256k:
the planner counts apart the prompts too long for any replica to prefill within the TTFT SLO."""


class RouterMetrics:
    """Requests by status, TTFT / inter-token / end-to-end latency, requests in flight."""

    def __init__(self, router_id: str) -> None:
        self.registry = CollectorRegistry()
        self.router_id = router_id

        def histogram(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, ["router"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
            return h.labels(router_id)

        self._requests = Counter("splitserve_requests", "Generate calls by final gRPC status.", ["router", "status"], registry=self.registry)
        self.ttft = histogram("splitserve_time_to_first_token_seconds", "Call start to first token.")
        self.inter_token = histogram("splitserve_inter_token_latency_seconds", "Time between tokens of one stream.")
        self.request_inter_token = histogram(
            "splitserve_request_inter_token_latency_seconds",
            "Each finished stream's mean time between tokens, first token to last (what an ITL SLO judges a request by).",
        )
        self.e2e = histogram("splitserve_e2e_latency_seconds", "Call start to last response.")
        self.path_first_token = histogram(
            "splitserve_serving_path_first_token_seconds",
            "What the serving path (this router, Ray) added to a request's TTFT: the router's TTFT minus the decode worker's own.",
        )
        self._routed = Counter(
            "splitserve_routing_decisions", "Cache-aware routing decisions by where the prompt is prefilled.", ["router", "target"], registry=self.registry
        )
        self.routed_cached_tokens = Counter(
            "splitserve_routing_cached_tokens", "Prompt tokens the chosen worker held cached (any tier) at decision time.", ["router"], registry=self.registry
        ).labels(router_id)
        self._migrations = Counter(
            "splitserve_migrations",
            "Generate calls moved to another decode replica after theirs died, by whether tokens had streamed.",
            ["router", "stage"],
            registry=self.registry,
        )
        self.migration = histogram(
            "splitserve_migration_seconds", "A decode replica's death noticed to the migrated call's next event from another replica."
        )
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens", "Prompt tokens of finished Generate calls (what the planner sizes prefill by).", ["router"], registry=self.registry
        ).labels(router_id)
        self.prompt_length = Histogram(
            "splitserve_prompt_length_tokens", "Prompt tokens of each finished Generate call (the planner counts the prompts too long for the TTFT SLO).",
            ["router"], buckets=PROMPT_LENGTH_BUCKETS[:-1], registry=self.registry,
        ).labels(router_id)
        self.output_tokens = Counter(
            "splitserve_output_tokens", "Tokens streamed to clients (what the planner sizes decode by).", ["router"], registry=self.registry
        ).labels(router_id)
        self._http_requests = Counter(
            "splitserve_http_requests", "HTTP requests (OpenAI and KServe APIs) by method, route and status code.",
            ["router", "method", "route", "status"], registry=self.registry,
        )
        self._http_latency = Histogram(
            "splitserve_http_request_duration_seconds", "HTTP request start to its response's end (a stream's included), by route.",
            ["router", "route"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.inflight = Gauge("splitserve_requests_inflight", "Generate calls in flight.", ["router"], registry=self.registry).labels(router_id)

    def routed(self, to_prefill_worker: bool, cached_tokens: int) -> None:
        self._routed.labels(self.router_id, "prefill" if to_prefill_worker else "decode").inc()
        self.routed_cached_tokens.inc(cached_tokens)

    def migrated(self, mid_stream: bool) -> None:
        self._migrations.labels(self.router_id, "mid_stream" if mid_stream else "before_first_token").inc()

    def finished(self, status: str) -> None:
        self._requests.labels(self.router_id, status).inc()

    def http_finished(self, method: str, route: str, status: int, duration_s: float) -> None:
        """``route``: the path template that matched (``/v1/chat/completions``), so ids never become labels."""
        self._http_requests.labels(self.router_id, method, route, str(status)).inc()
        self._http_latency.labels(self.router_id, route).observe(duration_s)
