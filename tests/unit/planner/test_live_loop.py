"""The planner loop's own duties: act only on changes, dry runs, connector errors with backoff, events."""

import asyncio
import json
import logging

import pytest
from prometheus_client import start_http_server

from planner.config import PlannerConfig
from planner.connector import ConnectorError, PoolReplicas
from planner.live import ClusterSource, PlannerLoop, PlannerMetrics
from planner.perf_model import PerfModel
from planner.observation import Observation
from planner.policy import SLAPlanner
from proto import splitserve_pb2 as pb
from router.frontend.metrics import PROMPT_LENGTH_BUCKETS, RouterMetrics

PROFILE = PerfModel(prefill=[(1, 0.01), (1000, 1.0)], decode=[(1, 0.02), (64, 0.6)])


class FakeSource:
    """Stands in for the cluster's metrics: a fixed load every interval."""

    def __init__(self, prompt_tokens_per_s: float, prompt_length_counts: tuple[tuple[float, int], ...] = (), slo_misses: int | None = None) -> None:
        self.rate = prompt_tokens_per_s
        self.prompt_length_counts = prompt_length_counts
        self.slo_misses = slo_misses

    async def observe(self, now_s: float) -> Observation:
        return Observation(
            time_s=now_s, duration_s=10.0, num_requests=round(self.rate / 100), num_prompt_tokens=round(self.rate * 10), num_output_tokens=10,
            prompt_length_counts=self.prompt_length_counts, slo_misses=self.slo_misses,
        )


class FakeConnector:
    """Stands in for the cluster's controller: pools as set, and refusals on demand."""

    def __init__(self) -> None:
        self.targets = {"prefill": 1, "decode": 1}
        self.calls: list[tuple[str, int]] = []
        self.refuse = 0

    async def pools(self):
        return {p: PoolReplicas(p, n, n) for p, n in self.targets.items()}

    async def set_replicas(self, pool: str, target: int) -> None:
        self.calls.append((pool, target))
        if self.refuse:
            self.refuse -= 1
            raise ConnectorError("the controller refused")
        self.targets[pool] = target


def _logged(caplog, **loads) -> list[dict]:
    """The planner's JSON decision lines, oldest first (``loads``: json.loads' keyword arguments)."""
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planner: {")]
    return [json.loads(m.removeprefix("planner: "), **loads) for m in messages]


def _loop(source, connector, **kwargs):
    config = PlannerConfig(interval_s=10.0, max_prefill=4, startup_s=0.0, burst_growth_above_deployment=True)
    return PlannerLoop(SLAPlanner(config, PROFILE), connector, source, metrics=PlannerMetrics(), backoff_s=20.0, **kwargs)


def test_a_prompt_burst_grows_prefill_and_only_changes_are_sent():
    connector = FakeConnector()
    loop = _loop(FakeSource(2500), connector)
    for t in (0.0, 10.0, 20.0):
        asyncio.run(loop.step(t))
    assert connector.targets["prefill"] >= 3 and connector.targets["decode"] == 1
    assert len(connector.calls) == len(set(connector.calls))  # a target already set is never sent again
    assert loop.metrics.desired.labels("prefill")._value.get() == connector.targets["prefill"]


def test_a_dry_run_decides_but_changes_nothing():
    connector = FakeConnector()
    loop = _loop(FakeSource(2500), connector, dry_run=True)
    decision = asyncio.run(loop.step(0.0))
    assert decision.targets["prefill"] > 1 and connector.calls == []


def test_a_refusing_connector_is_counted_and_retried_after_a_backoff():
    connector = FakeConnector()
    connector.refuse = 1
    loop = _loop(FakeSource(2500), connector)
    asyncio.run(loop.step(0.0))
    asyncio.run(loop.step(10.0))  # within the 20 s backoff: decides, does not act
    assert len(connector.calls) == 1 and loop.metrics.connector_errors._value.get() == 1
    asyncio.run(loop.step(30.0))
    assert connector.calls[-1][0] == "prefill" and connector.targets["prefill"] > 1


def test_an_slo_no_count_meets_is_an_event_per_interval_while_holding_at_max():
    connector = FakeConnector()
    loop = _loop(FakeSource(1e6), connector)
    for t in (0.0, 10.0, 20.0):
        asyncio.run(loop.step(t))
    assert connector.targets["prefill"] == 4
    assert loop.metrics.infeasible.labels("prefill")._value.get() == 3


def test_infeasible_requests_are_counted_and_logged_as_strict_json(caplog):
    counts = tuple((bound, {128.0: 5, float("inf"): 3}.get(bound, 0)) for bound in PROMPT_LENGTH_BUCKETS)
    config = PlannerConfig(interval_s=10.0, max_prefill=4, startup_s=0.0, burst_growth_above_deployment=True)
    loop = PlannerLoop(SLAPlanner(config, PROFILE), FakeConnector(), FakeSource(2500, counts), metrics=PlannerMetrics())  # the 3 past 256k tokens: no replica prefills them in 2 s
    with caplog.at_level(logging.INFO, logger="planner.live"):
        for t in (0.0, 10.0):
            assert asyncio.run(loop.step(t)).infeasible_requests == 3
    assert loop.metrics.infeasible_requests._value.get() == 6

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    lines = _logged(caplog, parse_constant=no_constants)
    assert len(lines) == 2
    assert lines[-1]["infeasible_requests"] == 3
    assert lines[-1]["observation"]["prompt_length_counts"] == {"128": 5, "+Inf": 3}


class ScheduledSource(FakeSource):
    """A load that changes: prompt tokens/s by the interval's end time."""

    def __init__(self, schedule) -> None:
        super().__init__(0.0)
        self.schedule = schedule

    async def observe(self, now_s: float) -> Observation:
        self.rate = self.schedule(now_s)
        return await super().observe(now_s)


def test_a_level_let_go_is_counted_and_logged(caplog):
    """Ten-second intervals, no start-up: a window of 200 s (k = 3), so a level is six intervals.
    200 prompt tokens/s need 2 prefill replicas (a 1,000-token prompt takes 1 s of the 2 s SLO); the
    first interval grows the deployment's 1 to 2, and the pool settles there. 1,500 tokens/s for
    80 s from 300 s grow it to 4: a level of its own, from the 2 it had settled at. Two intervals
    after the load is back, it is let go, once, and the pool is back at 2."""
    connector = FakeConnector()
    config = PlannerConfig(interval_s=10.0, max_prefill=4, startup_s=0.0, scale_down_cooldown_s=0.0, burst_memory_above_deployment=True, burst_growth_above_deployment=True)
    loop = PlannerLoop(SLAPlanner(config, PROFILE), connector, ScheduledSource(lambda t: 1500 if 300 <= t < 380 else 200), metrics=PlannerMetrics())
    with caplog.at_level(logging.INFO, logger="planner.live"):
        decisions = {t: asyncio.run(loop.step(float(t))) for t in range(0, 500, 10)}
    released = [t for t, d in decisions.items() if d.released_levels]
    assert released == [390] and decisions[390].released_levels == ("prefill",)
    assert decisions[290].targets["prefill"] == 2 and decisions[380].targets["prefill"] == 4
    assert decisions[390].reasons["prefill"].endswith("; the level of 80 s is over, 2 carried the last 2 intervals")
    assert connector.targets["prefill"] == 2
    assert loop.metrics.levels_released.labels("prefill")._value.get() == 1
    assert loop.metrics.levels_released.labels("decode")._value.get() == 0
    lines = _logged(caplog)
    assert [line["released_levels"] for line in lines].count(["prefill"]) == 1


def test_a_trend_not_bet_on_is_counted_and_logged(caplog):
    """A deployment of 4 prefill replicas and a load rising 300 prompt tokens/s every interval: at
    70 s the load has risen over each of the last three start-ups (one interval each here) and 5
    replicas would carry it an interval ahead, while the load itself needs 4. That is a bet the
    planner has saved nothing for (the pool never went below its deployment), so the pool stays at
    4; with ``trend_bets_from_savings`` off it grows to 5."""
    decided = {}
    for funded in (True, False):
        connector = FakeConnector()
        connector.targets["prefill"] = 4
        config = PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0, trend_bets_from_savings=funded, burst_growth_above_deployment=True)
        loop = PlannerLoop(SLAPlanner(config, PROFILE), connector, ScheduledSource(lambda t: 200 + 30 * t), metrics=PlannerMetrics())
        with caplog.at_level(logging.INFO, logger="planner.live"):
            decided[funded] = [asyncio.run(loop.step(float(t))) for t in range(0, 80, 10)]
        if funded:
            assert loop.metrics.trends_not_bet.labels("prefill")._value.get() == 1
            assert loop.metrics.trends_not_bet.labels("decode")._value.get() == 0
            assert loop.metrics.saved._value.get() == 0.0
            lines = _logged(caplog)
            assert lines[-1]["unfunded_trends"] == ["prefill"] and lines[-1]["saved_replica_s"] == 0.0
    assert [d.targets["prefill"] for d in decided[True]] == [4] * 8
    assert decided[True][-1].unfunded_trends == ("prefill",) and decided[True][-1].needed["prefill"] == 4
    assert "5 for the load a start-up and half an interval ahead, not bet on: 0 replica-seconds saved below the deployment's 4, 10 needed" in decided[True][-1].reasons["prefill"]
    assert decided[False][-1].targets["prefill"] == 5 and decided[False][-1].unfunded_trends == ()


def test_a_burst_ridden_out_at_the_deployment_is_counted_and_logged(caplog):
    """Ten-second intervals, no start-up, so a shift is two intervals: a deployment of 1 prefill
    replica (200 prompt tokens/s need 1 here, after the first interval's 2) meets 1,500 tokens/s
    for one interval, and is held at 1 in it and the next (the last two start-ups still ask for
    it), counted and logged; the same load for three intervals is a shift, and the pool grows at
    its second."""
    connector = FakeConnector()
    config = PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0)
    loop = PlannerLoop(SLAPlanner(config, PROFILE), connector, ScheduledSource(lambda t: 1500 if t in (100, 200, 210, 220) else 100), metrics=PlannerMetrics())
    with caplog.at_level(logging.INFO, logger="planner.live"):
        decisions = {t: asyncio.run(loop.step(float(t))) for t in range(0, 240, 10)}
    assert decisions[100].targets["prefill"] == 1 and decisions[100].held_at_deployment == ("prefill",)
    assert "held at 1 for" in decisions[100].reasons["prefill"]
    assert [decisions[t].targets["prefill"] for t in (200, 210, 220)] == [1, 4, 4]
    held = [t for t, d in decisions.items() if d.held_at_deployment]
    assert held == [100, 110, 200] and loop.metrics.bursts_ridden_out.labels("prefill")._value.get() == 3
    assert loop.metrics.bursts_ridden_out.labels("decode")._value.get() == 0
    assert [line["held_at_deployment"] for line in _logged(caplog)].count(["prefill"]) == 3


def test_room_kept_below_the_deployment_for_a_rise_is_a_gauge_and_logged(caplog):
    """Ten-second intervals, no start-up (a reaction of one interval): a deployment of 6 prefill
    replicas meets 100 prompt tokens/s (1 replica) and, at 140 s, 1,500 (4). That interval rose by
    3 from the one before, and the pool keeps room for it while it is the load's; the gauge
    reads 0 again in the next interval."""
    connector = FakeConnector()
    connector.targets["prefill"] = 6
    loop = PlannerLoop(
        SLAPlanner(PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0), PROFILE), connector,
        ScheduledSource(lambda t: 1500 if t == 140 else 100), metrics=PlannerMetrics(),
    )
    gauge = loop.metrics.rise_room.labels("prefill")
    with caplog.at_level(logging.INFO, logger="planner.live"):
        for t in range(0, 150, 10):
            decision = asyncio.run(loop.step(float(t)))
        assert decision.rise_room == {"prefill": 3} and gauge._value.get() == 3
        assert _logged(caplog)[-1]["rise_room"] == {"prefill": 3}
        decision = asyncio.run(loop.step(150.0))
    assert decision.rise_room == {} and gauge._value.get() == 0 and _logged(caplog)[-1]["rise_room"] == {}
    assert loop.metrics.rise_room.labels("decode")._value.get() == 0


def test_the_error_budget_is_a_gauge_and_logged(caplog):
    """1,000 prompt tokens/s is 10 requests an interval of 10 s; 1 of them misses an SLO in each:
    the budget is 0.05 of the hour's requests at the rate seen so far (3,600), less those that
    missed."""
    loop = _loop(FakeSource(1000.0, slo_misses=1), FakeConnector())
    with caplog.at_level(logging.INFO, logger="planner.live"):
        for t in range(0, 40, 10):
            decision = asyncio.run(loop.step(float(t)))
    assert decision.error_budget == pytest.approx(176.0) and loop.metrics.error_budget._value.get() == pytest.approx(176.0)
    assert [line["error_budget"] for line in _logged(caplog)] == pytest.approx([179.0, 178.0, 177.0, 176.0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="planner.live"):
        asyncio.run(_loop(FakeSource(1000.0), FakeConnector()).step(0.0))  # nothing counts the misses
    assert _logged(caplog)[-1]["error_budget"] is None


def test_the_cluster_source_reads_prompt_lengths_from_the_routers_metrics_and_running_sequences_from_the_status():
    metrics = RouterMetrics("router-0")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        replicas = [pb.ReplicaStatus(replica_id="d0", pool="decode", num_running=7, num_queued_prefill_tokens=400),
                    pb.ReplicaStatus(replica_id="d1", pool="decode", num_running=5),
                    pb.ReplicaStatus(replica_id="p0", pool="prefill", num_running=3, num_queued_prefill_tokens=9000)]
        status = pb.ClusterStatus(routers=[pb.RouterStatus(router_id="router-0", metrics_url=f"http://127.0.0.1:{server.server_port}/metrics")], replicas=replicas)
        source = ClusterSource(lambda: status)
        assert asyncio.run(source.observe(0.0)) is None
        metrics.prompt_length.observe(1000)
        metrics.prompt_length.observe(300_000)
        observation = asyncio.run(source.observe(10.0))
    finally:
        server.shutdown()
        thread.join()
    assert {bound: n for bound, n in observation.prompt_length_counts if n} == {1024.0: 1, float("inf"): 1}
    assert [bound for bound, _ in observation.prompt_length_counts] == list(PROMPT_LENGTH_BUCKETS)
    assert observation.decode_running == 12  # the decode replicas' running sequences, not prefill's
    assert observation.queued_prefill_tokens == 9400  # prompts waiting for a prefill anywhere, a decode replica's own too


def test_the_cluster_source_counts_the_requests_that_missed_an_slo_from_the_routers_histograms():
    metrics = RouterMetrics("router-0")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        status = pb.ClusterStatus(routers=[pb.RouterStatus(router_id="router-0", metrics_url=f"http://127.0.0.1:{server.server_port}/metrics")])
        counting, blind = ClusterSource(lambda: status, (2.5, 0.1)), ClusterSource(lambda: status)
        assert asyncio.run(counting.observe(0.0)) is None and asyncio.run(blind.observe(0.0)) is None
        metrics.ttft.observe(3.0)  # one first token beyond 2.5 s, two within
        metrics.ttft.observe(0.4)
        metrics.ttft.observe(2.4)
        metrics.request_inter_token.observe(0.2)  # one request's mean over 0.1 s, one within
        metrics.request_inter_token.observe(0.04)
        counted, not_counted = asyncio.run(counting.observe(30.0)), asyncio.run(blind.observe(30.0))
        metrics.ttft.observe(0.2)
        assert asyncio.run(counting.observe(60.0)).slo_misses == 0  # the next interval: only its own
    finally:
        server.shutdown()
        thread.join()
    assert counted.slo_misses == 2
    assert not_counted.slo_misses is None  # no SLOs given: unknown, not zero


def test_launch_protection_is_a_gauge_and_logged_until_the_load_has_needed_the_deployment(caplog):
    """Ten-second intervals, no start-up (a window and warm-up of 200 s): a deployment of 4 prefill
    replicas meets 100 prompt tokens/s (2 replicas: each 1,000-token prompt takes half the 2 s
    SLO). Past the warm-up the pool keeps its 4, the gauge reads 1, until 1,500 tokens/s at 300 s
    need the 4; then the gauge reads 0 and, once the window has let the 1,500 go, the pool shrinks."""
    connector = FakeConnector()
    connector.targets["prefill"] = 4
    loop = PlannerLoop(
        SLAPlanner(PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0, scale_down_cooldown_s=0.0), PROFILE), connector,
        ScheduledSource(lambda t: 1500 if t == 300 else 100), metrics=PlannerMetrics(),
    )
    gauge = loop.metrics.launch_protection.labels("prefill")
    with caplog.at_level(logging.INFO, logger="planner.live"):
        decisions = {t: asyncio.run(loop.step(float(t))) for t in range(0, 300, 10)}
        assert {d.targets["prefill"] for d in decisions.values()} == {4}
        assert "prefill" in decisions[290].launch_protected and gauge._value.get() == 1
        assert "no interval's load has needed the deployment's 4 yet (300 s observed)" in decisions[290].reasons["prefill"]
        assert "prefill" in _logged(caplog)[-1]["launch_protected"]
        decisions.update({t: asyncio.run(loop.step(float(t))) for t in range(300, 600, 10)})
    assert "prefill" not in decisions[300].launch_protected and gauge._value.get() == 0
    assert "prefill" not in _logged(caplog)[-1]["launch_protected"]
    assert decisions[490].targets["prefill"] == 4 and decisions[590].targets["prefill"] == 2
    # Off, the same load shrinks the pool at the warm-up's end and the gauge never reads 1.
    connector = FakeConnector()
    connector.targets["prefill"] = 4
    off = PlannerLoop(
        SLAPlanner(PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0, scale_down_cooldown_s=0.0, hold_deployment_until_needed_s=0.0), PROFILE),
        connector, FakeSource(100.0), metrics=PlannerMetrics(),
    )
    seen = [asyncio.run(off.step(float(t))) for t in range(0, 300, 10)]
    assert seen[-1].targets["prefill"] == 2 and all(d.launch_protected == () for d in seen)
    assert off.metrics.launch_protection.labels("prefill")._value.get() == 0


def test_a_long_level_kept_below_the_deployment_is_a_gauge_and_logged(caplog):
    """As above (a window of 200 s), 1,500 prompt tokens/s for 200 s from 300 s need the deployment's
    4; the window alone would let them go 200 s after they end. Kept twice as long after as they
    held (and an interval), the pool stays at 4 to about 900 s, with the gauge at 4 and the level
    logged; then it shrinks and the gauge reads 0."""
    connector = FakeConnector()
    connector.targets["prefill"] = 4
    loop = PlannerLoop(
        SLAPlanner(PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0, scale_down_cooldown_s=0.0), PROFILE), connector,
        ScheduledSource(lambda t: 1500 if 300 <= t < 500 else 100), metrics=PlannerMetrics(),
    )
    gauge = loop.metrics.long_level.labels("prefill")
    with caplog.at_level(logging.INFO, logger="planner.live"):
        decisions = {t: asyncio.run(loop.step(float(t))) for t in range(0, 850, 10)}
        assert {decisions[t].targets["prefill"] for t in range(300, 850, 10)} == {4}
        assert decisions[840].long_levels == {"prefill": 4} and gauge._value.get() == 4
        assert _logged(caplog)[-1]["long_levels"] == {"prefill": 4}
        assert "4 kept for the level of 3 minutes that needed it until 6 minutes ago" in decisions[840].reasons["prefill"]
        decisions.update({t: asyncio.run(loop.step(float(t))) for t in range(850, 1000, 10)})
    assert decisions[990].targets["prefill"] == 2 and gauge._value.get() == 0 and _logged(caplog)[-1]["long_levels"] == {}


def test_changes_of_direction_are_a_gauge_and_the_flap_limit_s_holds_are_counted_and_logged(caplog):
    """A window of one 10-second interval: 1,500 prompt tokens/s need the deployment's 4 prefill
    replicas and 100 need 2, so a load that alternates turns the pool every interval until the
    limit (6 an hour) holds it at 4; the gauge counts the turns, the counter the holds."""
    connector = FakeConnector()
    connector.targets["prefill"] = 4
    config = PlannerConfig(interval_s=10.0, max_prefill=8, startup_s=0.0, scale_down_cooldown_s=0.0, base_window_s=10.0, rise_start_ups=0, level_memory_lengths=0.0)
    loop = PlannerLoop(SLAPlanner(config, PROFILE), connector, ScheduledSource(lambda t: 1500 if t % 20 == 0 else 100), metrics=PlannerMetrics())
    with caplog.at_level(logging.INFO, logger="planner.live"):
        decisions = [asyncio.run(loop.step(float(t))) for t in range(0, 300, 10)]
    targets = [d.targets["prefill"] for d in decisions]
    assert 2 in targets[:10] and set(targets[-10:]) == {4}
    held = [d for d in decisions if "prefill" in d.flap_held]
    assert held and held[0].direction_changes["prefill"] == 5 and "of the 6 it may make" in held[0].reasons["prefill"]
    assert loop.metrics.direction_changes.labels("prefill")._value.get() == decisions[-1].direction_changes["prefill"] == 5
    assert loop.metrics.flap_holds.labels("prefill")._value.get() == len(held)
    assert _logged(caplog)[-1]["direction_changes"]["prefill"] == 5 and _logged(caplog)[-1]["flap_held"] in ([], ["prefill"])
