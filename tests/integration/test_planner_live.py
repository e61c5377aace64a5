"""The planner against a live cluster through the Ray connector.

A burst of long prompts raises the prefill pool 1 -> 2 (and not decode: their one-token answers
come out of prefill) and a burst of long answers the decode pool 1 -> 2 (and not prefill); each
returns to 1 after the cooldown, drained. No request fails, no block leaks.
The perf model is a profile written for the tiny model (what ``planner.profile`` would measure
is beside the point here: the test is the loop, the connector and the drain, live).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from planner.config import PlannerConfig
from planner.connectors.ray import RayConnector
from planner.live import ClusterSource, PlannerLoop
from planner.perf_model import PerfModel
from planner.policy import SLAPlanner
from prefill_worker.config import PrefillWorkerConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROFILE = PerfModel(prefill=[(1, 0.01), (300, 1.0)], decode=[(1, 0.02), (64, 0.6)], source="a profile sized for the test's bursts")
"""One replica prefills 300 prompt tokens per second and decodes about 50 sequences at 0.5 s per token."""
CONFIG = PlannerConfig(
    ttft_slo_s=2.0, itl_slo_s=0.5, interval_s=2.0, min_prefill=1, max_prefill=2, min_decode=1, max_decode=2,
    scale_down_cooldown_s=4.0, startup_s=2.0,
    base_window_s=10.0,  # the derived window ((2 + 2) / 0.05 = 80 s) would hold each burst's replicas over a minute
    # The tiny model meets these SLOs with room to spare, so the SLO's error budget would hold each
    # burst at the deployment; what is tested here is the loop, the connector and the drain.
    error_budget_above_deployment=False,
)


class Load:
    """Clients sending one kind of request back to back until stopped; every outcome kept."""

    def __init__(self, client, prompts, max_tokens: int) -> None:
        self.stop = threading.Event()
        self.done, self.errors = 0, []
        self.threads = [threading.Thread(target=self._run, args=(client, p, max_tokens)) for p in prompts]
        for t in self.threads:
            t.start()

    def _run(self, client, prompt, max_tokens) -> None:
        while not self.stop.is_set():
            try:
                tokens = [t for r in client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True) for t in r.token_ids]
                assert len(tokens) == max_tokens
                self.done += 1
            except Exception as e:  # noqa: BLE001 - collected and asserted empty
                self.errors.append(e)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def _step_until(loop: PlannerLoop, connector: RayConnector, predicate, timeout_s: float, timeline: list):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decision = asyncio.run(loop.step())
        pools = asyncio.run(connector.pools())
        if decision is not None:
            timeline.append((round(time.monotonic() - timeline[0], 1), dict(decision.targets), {p: v.ready for p, v in pools.items()}))
        if predicate(pools):
            return pools
        time.sleep(CONFIG.interval_s)
    raise AssertionError(f"not reached within {timeout_s} s; timeline {timeline[1:]}")


def test_bursts_scale_each_pool_up_and_back_down(ray_session, tiny_llama_dir):
    config = ClusterConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=256, max_model_len=512),
        worker=WorkerConfig(num_threads=1, max_local_prefill_tokens=0),
        prefill=PrefillWorkerConfig(num_threads=1),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
    )
    with running_cluster(config) as cluster, SplitServeClient(cluster.router_status.grpc_address) as client:
        connector = RayConnector(drain_timeout_s=60)
        loop = PlannerLoop(SLAPlanner(CONFIG, PROFILE), connector, ClusterSource(client.cluster_status, (CONFIG.ttft_slo_s, CONFIG.itl_slo_s)))
        timeline: list = [time.monotonic()]
        asyncio.run(loop.step())  # the baseline scrape

        prompts = Load(client, random_prompts([300] * 6, seed=11), max_tokens=1)
        _step_until(loop, connector, lambda p: p["prefill"].ready == 2, 90, timeline)
        grew = [d.reasons["decode"] for d in loop.decisions if d.targets["decode"] != 1]
        assert grew == []  # long prompts alone never grew decode: their one-token answers come out of prefill
        prompts.finish()
        _step_until(loop, connector, lambda p: p["prefill"].target == 1 and p["prefill"].ready == 1 and not p["prefill"].draining, 90, timeline)

        # Two clients: their chat-templated prompts (~150 tokens, 0.5 s each by the profile) stay under
        # a third of one prefill replica, while their answers need more decode replicas than max.
        counting = ClusterSource(client.cluster_status, (CONFIG.ttft_slo_s, CONFIG.itl_slo_s))
        asyncio.run(counting.observe(time.monotonic()))  # a baseline for the misses counted over the answers' burst
        answers = Load(client, random_prompts([8] * 2, seed=12), max_tokens=100)
        quiet = len(loop.decisions)
        _step_until(loop, connector, lambda p: p["decode"].ready == 2, 90, timeline)
        grew = [d.reasons["prefill"] for d in loop.decisions[quiet:] if d.targets["prefill"] != 1]
        assert grew == []  # long answers alone never grew prefill
        answers.finish()
        counted = asyncio.run(counting.observe(time.monotonic()))
        _step_until(loop, connector, lambda p: p["decode"].target == 1 and p["decode"].ready == 1 and not p["decode"].draining, 90, timeline)
        status = client.cluster_status()

    print("\nplanner timeline (s, targets, ready):", *timeline[1:], sep="\n  ")
    assert prompts.errors == [] and answers.errors == [] and prompts.done and answers.done
    # The routers' TTFT and per-request ITL histograms count the requests that missed an SLO, live.
    assert counted.num_requests >= answers.done - 2 and counted.slo_misses is not None and 0 <= counted.slo_misses <= counted.num_requests
    assert all(r.num_free_kv_blocks == r.num_kv_blocks for r in status.replicas)
    assert {p.pool: p.num_restarts for p in status.pools} == {"prefill": 0, "decode": 0}
