"""What the live planner reads each interval: the routers' Prometheus series, as interval deltas.

Every router exports request counts, prompt and output tokens, and TTFT, inter-token latency (each
gap, and each request's mean) and prompt-length histograms (router/frontend/metrics.py). The planner scrapes each router's ``/metrics`` (the
URLs the controller's cluster status lists), sums the routers, and turns two scrapes into one
interval: counts by difference, percentiles from the difference of the histogram buckets (as
PromQL's ``histogram_quantile`` does, linear within a bucket), prompt lengths as per-bucket counts.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "splitserve_requests": "requests",
    "splitserve_prompt_tokens": "prompt_tokens",
    "splitserve_output_tokens": "output_tokens",
}
_HISTOGRAMS = {
    "splitserve_time_to_first_token_seconds": "ttft",
    "splitserve_inter_token_latency_seconds": "itl",
    "splitserve_request_inter_token_latency_seconds": "request_itl",
    "splitserve_prompt_length_tokens": "prompt_length",
}


@dataclass
class Scrape:
    """Cumulative series summed over routers at one moment (``at_s``: time.monotonic)."""

    at_s: float
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    """Histogram name -> upper bound -> cumulative count."""


@dataclass(frozen=True)
class IntervalStats:
    """What happened between two scrapes."""

    duration_s: float
    requests: float
    prompt_tokens: float
    output_tokens: float
    ttft_p90_s: float | None
    """None when no request got its first token in the interval."""
    itl_p90_s: float | None
    ttft_mean_s: float | None = None
    itl_mean_s: float | None = None
    prompt_length_counts: tuple[tuple[float, int], ...] = ()
    """Requests by prompt length: (upper bound in tokens, count) per bucket, bounds rising, the last
    inf (router.frontend.metrics.PROMPT_LENGTH_BUCKETS); empty when no router exports the histogram."""


def parse(text: str, at_s: float, into: Scrape | None = None) -> Scrape:
    """Add one router's exposition ``text`` to ``into`` (a new Scrape when None)."""
    scrape = into or Scrape(at_s)
    for family in text_string_to_metric_families(text):
        if family.name in _COUNTERS:
            key = _COUNTERS[family.name]
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            scrape.counters[key] = scrape.counters.get(key, 0.0) + total
        elif family.name in _HISTOGRAMS:
            buckets = scrape.buckets.setdefault(_HISTOGRAMS[family.name], {})
            name = _HISTOGRAMS[family.name]
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
                elif sample.name.endswith(("_sum", "_count")):
                    key = f"{name}{sample.name[sample.name.rindex('_'):]}"
                    scrape.counters[key] = scrape.counters.get(key, 0.0) + sample.value
    return scrape


def scrape(urls: list[str], at_s: float, timeout_s: float = 5.0) -> Scrape:
    """Every router's series at once, summed. Raises OSError when a router cannot be read."""
    out = Scrape(at_s)
    for url in urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            parse(response.read().decode(), at_s, out)
    return out


def interval(before: Scrape, after: Scrape) -> IntervalStats:
    """The interval between two scrapes (a router that restarted counts from zero again)."""

    def delta(key: str) -> float:
        return max(0.0, after.counters.get(key, 0.0) - before.counters.get(key, 0.0))

    return IntervalStats(
        duration_s=max(1e-9, after.at_s - before.at_s),
        requests=delta("requests"),
        prompt_tokens=delta("prompt_tokens"),
        output_tokens=delta("output_tokens"),
        ttft_p90_s=quantile(0.9, before.buckets.get("ttft", {}), after.buckets.get("ttft", {})),
        itl_p90_s=quantile(0.9, before.buckets.get("itl", {}), after.buckets.get("itl", {})),
        ttft_mean_s=delta("ttft_sum") / delta("ttft_count") if delta("ttft_count") else None,
        itl_mean_s=delta("itl_sum") / delta("itl_count") if delta("itl_count") else None,
        prompt_length_counts=bucket_counts(before.buckets.get("prompt_length", {}), after.buckets.get("prompt_length", {})),
    )


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of the observations between two cumulative bucket snapshots; None if there were none."""
    bounds, counts = _cumulative_deltas(before, after)
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound  # beyond the last finite bucket: its bound is all we know
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def count_above(bound: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """How many observations between two cumulative bucket snapshots were above ``bound``: exact
    when ``bound`` is a bucket's bound, else linear within its bucket (as ``quantile`` reads one);
    None when ``after`` has no buckets (the series is not exported)."""
    bounds, counts = _cumulative_deltas(before, after)
    if not counts:
        return None
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in zip(bounds, counts):
        if bound <= upper:
            if upper == float("inf"):
                at_or_below = lower_count  # beyond the last finite bucket nothing is known: counted above
            else:
                at_or_below = lower_count + (count - lower_count) * (bound - lower_bound) / (upper - lower_bound)
            return max(0.0, counts[-1] - at_or_below)
        lower_bound, lower_count = upper, count
    return 0.0


def bucket_counts(before: dict[float, float], after: dict[float, float]) -> tuple[tuple[float, int], ...]:
    """(upper bound, observations in that bucket alone) between two cumulative bucket snapshots,
    bounds rising; empty when ``after`` has no buckets."""
    counts = []
    below = 0.0
    for bound, cumulative in zip(*_cumulative_deltas(before, after)):
        counts.append((bound, max(0, round(cumulative - below))))
        below = max(below, cumulative)
    return tuple(counts)


def _cumulative_deltas(before: dict[float, float], after: dict[float, float]) -> tuple[list[float], list[float]]:
    """(bounds rising, cumulative observations at or below each between the two snapshots); a
    router that restarted counts from zero, so no delta is negative."""
    bounds = sorted(after)
    return bounds, [max(0.0, after[b] - before.get(b, 0.0)) for b in bounds]
