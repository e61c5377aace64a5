"""Builds the Grafana dashboard the chart ships (splitserve/dashboards/splitserve.json).

Every expression reads series the code exports (tests/unit/deploy/test_dashboard.py checks each
metric name against the real collectors): the routers' (router/frontend/metrics.py), the workers'
(engine/metrics.py and the actors' collectors), the controller's and the planner's
(planner/live.py). Run ``python deploy/helm/render.py`` (``make chart``) to rewrite the file.
"""

from __future__ import annotations

from compact_json import dumps

RATE_WINDOW = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
PANEL_WIDTH = 12
PANEL_HEIGHT = 8


def _rate(series: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}[{RATE_WINDOW}]))"


def _quantiles(histogram: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram summed over every process (and ``by``)."""
    labels = f"le, {by}" if by else "le"
    legend_by = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket[{RATE_WINDOW}])))", f"p{round(q * 100)}{legend_by}")
            for q in QUANTILES]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Time to first token (router)", "s", _quantiles("splitserve_time_to_first_token_seconds")),
    ("Inter-token latency (router)", "s", _quantiles("splitserve_inter_token_latency_seconds")),
    ("Requests per second by status", "reqps", [(_rate("splitserve_requests_total", "status"), "{{status}}")]),
    ("Tokens per second", "short", [
        (_rate("splitserve_prompt_tokens_total"), "prompt"),
        (_rate("splitserve_output_tokens_total"), "output"),
    ]),
    ("Prefix-cache hit rate", "percentunit", [
        (f"{_rate('splitserve_routing_cached_tokens_total')} / {_rate('splitserve_prompt_tokens_total')}", "prompt tokens cached (routing)"),
        (f"{_rate('splitserve_kv_tier_hits_total', 'tier')} / ({_rate('splitserve_kv_tier_hits_total', 'tier')}"
         f" + {_rate('splitserve_kv_tier_misses_total', 'tier')})", "block lookups, {{tier}} tier"),
    ]),
    ("KV pool use (GPU tier) per pool", "percentunit", [
        ("sum by (pool) (splitserve_kv_blocks_used) / sum by (pool) (splitserve_kv_blocks_total)", "{{pool}} held"),
        ("sum by (pool) (splitserve_kv_blocks_cached) / sum by (pool) (splitserve_kv_blocks_total)", "{{pool}} cached"),
    ]),
    ("KV served per tier", "Bps", [
        (_rate("splitserve_kv_tier_bytes_total", "tier"), "served {{tier}}"),
        (_rate("splitserve_redis_tier_bytes_written_total"), "written redis"),
    ]),
    ("KV blocks evicted per tier", "short", [(_rate("splitserve_kv_tier_evictions_total", "tier"), "{{tier}}")]),
    ("KV hand-off time (decode side)", "s", _quantiles("splitserve_worker_kv_handoff_seconds")),
    ("KV hand-off bytes", "Bps", [
        (_rate("splitserve_kv_handoff_bytes_sent_total"), "sent (prefill)"),
        (_rate("splitserve_kv_handoff_bytes_received_total"), "received (decode)"),
    ]),
    ("Replicas per pool: planner desired vs actual", "short", [
        ("max by (pool) (splitserve_planner_desired_replicas)", "desired {{pool}}"),
        ("max by (pool) (splitserve_planner_needed_replicas)", "needed {{pool}}"),
        ("max by (pool) (splitserve_planner_ready_replicas)", "ready at decision {{pool}}"),
        ('sum by (pool) (splitserve_replicas{healthy="true"})', "healthy now {{pool}}"),
    ]),
    ("Queue depth", "short", [
        ("sum by (pool) (splitserve_worker_requests_waiting)", "waiting {{pool}}"),
        ("sum by (pool) (splitserve_worker_requests_running)", "running {{pool}}"),
        ("sum (splitserve_requests_inflight)", "in flight (routers)"),
    ]),
    ("Errors per second", "short", [
        (_rate('splitserve_requests_total{status!="OK"}', "status"), "{{status}}"),
        (_rate("splitserve_kv_handoff_failed_total", "pool"), "hand-off failed {{pool}}"),
        (_rate("splitserve_migrations_total", "stage"), "migrated {{stage}}"),
        (_rate("splitserve_replica_restarts_total", "pool"), "replica restarts {{pool}}"),
        (_rate("splitserve_worker_requests_failed_total", "pool"), "requests failed alone {{pool}}"),
        (_rate("splitserve_planner_connector_errors_total"), "planner connector errors"),
    ]),
    ("Planner: what keeps replicas below the deployment", "short", [
        ("max by (pool) (splitserve_planner_launch_protection)", "launch protection {{pool}} (1: kept at the deployment)"),
        ("max by (pool) (splitserve_planner_rise_room_replicas)", "room for rises {{pool}}"),
        ("max by (pool) (splitserve_planner_long_level_replicas)", "long level kept {{pool}} (replicas)"),
        ("max by (pool) (splitserve_planner_direction_changes_last_hour)", "changes of direction in the last hour {{pool}}"),
    ]),
    ("Planner: savings and error budget", "short", [
        ("max (splitserve_planner_saved_replica_seconds)", "replica-seconds saved below the deployment"),
        ("max (splitserve_planner_error_budget_requests)", "requests the SLO may still miss this hour"),
    ]),
]
"""(title, Grafana unit, [(PromQL, legend)]) in reading order, two panels per row."""


def _panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": (index % 2) * PANEL_WIDTH, "y": (index // 2) * PANEL_HEIGHT, "w": PANEL_WIDTH, "h": PANEL_HEIGHT},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model, with a Prometheus data-source variable."""
    return {
        "uid": "splitserve",
        "title": "splitserve",
        "tags": ["splitserve", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"}]},
        "panels": [_panel(i, *panel) for i, panel in enumerate(PANELS)],
    }


def dashboard_text() -> str:
    """The file's exact text."""
    return dumps(build_dashboard()) + "\n"
