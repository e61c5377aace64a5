"""bench.planner's policy that knows the trace: the hindsight schedule.

    python -m bench.planner --trace FILE --policies static hindsight

``hindsight`` is the cheapest prefill schedule chosen knowing every arrival. The decode pool stays at
the static split's count; the prefill pool follows one count per interval, static's among them. It
empties only where static's does: a count of none (the decode replicas prefill, their batches
stalled) is left out of a split that has prefill replicas, whose decode pool was not sized for it.
For a price ``lam`` per missed request, a dynamic program over the intervals minimises
replica-intervals (a replica added also pays for its start-up) plus ``lam`` times the TTFT misses
each interval would have with that many replicas, each interval starting with empty queues.
Bisection on ``lam`` finds the cheapest such schedule whose replay in bench.planner's Simulation
(start-up, queues carried over, drains) reaches static's attainment less 0.01, the issue's bar. It
is no causal policy: it shows what the trace allows, and its gap to ``splitserve`` is the price of
deciding without knowing what comes next.
"""

from __future__ import annotations

import heapq
import math



BISECTIONS = 14
"""Replays spent narrowing ``lam``, the price of a miss in replica-intervals."""


def interval_misses(trace, perf, config, counts: list[int], decode: int, cost_scale: float = 1.0) -> list[list[int]]:
    """For each interval and each of ``counts`` prefill replicas, its arrivals that miss the TTFT
    SLO when those replicas start the interval idle (each prompt goes to the one free first). With
    none, the ``decode`` replicas prefill instead (their stalled batches are left to the replay)."""
    windows = [[] for _ in range(int(trace[-1].time_s // config.interval_s) + 1)]
    for a in trace:
        windows[int(a.time_s // config.interval_s)].append(a)
    table = []
    for arrivals in windows:
        row = []
        for k in counts:
            free, missed = [0.0] * (k or decode), 0
            for a in arrivals:
                done = max(a.time_s, heapq.heappop(free)) + cost_scale * perf.prefill_s(a.prompt_tokens)
                heapq.heappush(free, done)
                missed += done - a.time_s > config.ttft_slo_s
            row.append(missed)
        table.append(row)
    return table


def cheapest_schedule(misses: list[list[int]], counts: list[int], lead: int, lam: float) -> list[int]:
    """Counts per interval minimising replica-intervals, ``lead`` more per replica added, plus
    ``lam`` per miss (the first interval's count is free to choose, as static's split is)."""
    cost = [counts[j] + lam * misses[0][j] for j in range(len(counts))]
    back = []
    for row in misses[1:]:  # (cheapest way into count j, the count it came from), for every j
        best = [min((cost[i] + lead * max(0, n - counts[i]), i) for i in range(len(counts))) for n in counts]
        cost = [into + counts[j] + lam * row[j] for j, (into, _) in enumerate(best)]
        back.append([i for _, i in best])
    j = min(range(len(counts)), key=cost.__getitem__)
    path = [j]
    for choice in reversed(back):
        j = choice[j]
        path.append(j)
    return [counts[j] for j in reversed(path)]


def replay_hindsight(trace, perf, config, static: dict, simulate, cost_scale: float = 1.0) -> tuple[dict, list]:
    """The cheapest schedule whose replay reaches ``static``'s attainment less 0.01 (``simulate(controller,
    initial)`` builds bench.planner's Simulation). The result says the price it took and whether it got there."""
    decode = static["split"]["decode"]
    counts = list(range(config.min_prefill if static["split"]["prefill"] == 0 else max(1, config.min_prefill), config.max_prefill + 1))
    misses = interval_misses(trace, perf, config, counts, decode, cost_scale)
    while len(counts) > 1 and not any(row[len(counts) - 2] for row in misses):  # a count that misses nothing anywhere is the most worth having
        counts.pop()
        misses = [row[:-1] for row in misses]
    lead, target = math.ceil(config.startup_s / config.interval_s), static["slo_attainment"] - 0.01

    def run(lam):
        schedule = cheapest_schedule(misses, counts, lead, lam)

        def controller(now, observation, pools, use):  # what must be ready now, and what must start for later
            w = round(now / config.interval_s)
            return {"prefill": max(schedule[min(w, len(schedule) - 1)], schedule[min(w + lead, len(schedule) - 1)]), "decode": decode}

        s = simulate(controller, (schedule[0], decode))
        return s.run(), s.timeline

    low, high = 1e-4, 1e2
    best = run(high)
    for _ in range(BISECTIONS):
        mid = math.sqrt(low * high)
        result = run(mid)
        if result[0]["slo_attainment"] >= target:
            high, best = mid, result
        else:
            low = mid
    best[0].update(miss_price=high, reached_target=best[0]["slo_attainment"] >= target)
    return best
