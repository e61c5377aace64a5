"""Queueing arithmetic the planner sizes prefill with: one replica's wait tail, the mean wait of
replicas sharing one queue, and Erlang C. Pure functions of load (in replicas) and times."""

from __future__ import annotations

import math


def wait_tail(rho: float, service_s: float, slack_s: float) -> float:
    """Share of requests an M/M/1 queue at load ``rho`` keeps waiting longer than ``slack_s``."""
    return rho * math.exp(-(1 - rho) * slack_s / service_s)


def pooled_wait_share(rho: float, num_replicas: int) -> float:
    """Mean wait over service time of ``num_replicas`` replicas sharing one queue at load ``rho``
    (Sakasegawa's M/M/c approximation): what the router's least-queued choice achieves."""
    return rho ** (math.sqrt(2 * (num_replicas + 1)) - 1) / (num_replicas * (1 - rho))


def erlang_c(servers: int, load: float) -> float:
    """Probability that a request waits in an M/M/c queue of ``servers`` at offered ``load`` (< servers)."""
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return servers * blocking / (servers - load * (1 - blocking))
