"""The planner's Ray connector on a live cluster: pools grow at once, shrink by draining.

A replica asked to go drains: routers send it nothing new, the streams it has finish, and it
leaves the map only when idle. The prefill pool can go to zero (decode prefills locally) and
come back.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import pytest
import ray

from bench.chaos import metric_total
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from planner.connectors.ray import RayConnector
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = dict(max_tokens=48, temperature=0, ignore_eos=True)
LONG = dict(GREEDY, max_tokens=400)
"""Streams long enough to be running on both replicas when one is told to drain."""


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    config = ClusterConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=128, max_model_len=512),
        worker=WorkerConfig(num_threads=1),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
    )
    with running_cluster(config) as c:
        yield c


def _pools(connector):
    return asyncio.run(connector.pools())


def test_a_pool_grows_and_drains_without_failing_or_moving_a_request(cluster):
    connector = RayConnector()
    assert {k: (v.target, v.ready) for k, v in _pools(connector).items()} == {"prefill": (1, 1), "decode": (1, 1)}
    asyncio.run(connector.set_replicas("decode", 2))
    # set_replicas returns once the new replica has started and joined the map ...
    status = ray.get(connector.controller.cluster_status.remote())
    assert len([r for r in status.replicas if r.pool == "decode" and not r.draining]) == 2
    assert _pools(connector)["decode"].starting == 0
    # ... and ready is healthy as the controller's last probe saw it: on a loaded machine one probe
    # may time out and mark a replica unhealthy until the next one answers.
    wait_until(lambda: _pools(connector)["decode"].ready == 2, 30)
    time.sleep(1.0)  # four router refreshes: its view has both replicas

    results, errors = [], []
    with SplitServeClient(cluster.router_status.grpc_address) as client:

        def stream(prompt):
            try:
                results.append([t for r in client.generate(prompt, **LONG) for t in r.token_ids])
            except Exception as e:  # noqa: BLE001 - collected and asserted empty below
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(p,)) for p in random_prompts([20] * 6)]
        for t in threads:
            t.start()
        busy = wait_until(lambda: len(b := {r.replica_id for r in client.cluster_status().replicas if r.pool == "decode" and r.num_running}) == 2 and b, 60)
        asyncio.run(connector.set_replicas("decode", 1))
        for t in threads:
            t.join(120)
        status = wait_until(lambda: (s := client.cluster_status()) and len([r for r in s.replicas if r.pool == "decode"]) == 1 and s, 60)

    assert errors == [] and len(results) == 6 and all(len(r) == LONG["max_tokens"] for r in results)
    router_metrics = urllib.request.urlopen(cluster.router_status.metrics_url, timeout=10).read().decode()
    assert metric_total(router_metrics, "splitserve_migrations_total") == 0  # the drained replica finished its own streams
    [left] = [r for r in status.replicas if r.pool == "decode"]
    assert len(busy) == 2 and left.num_free_kv_blocks == left.num_kv_blocks  # both served; no block leaked
    [pool] = [p for p in status.pools if p.pool == "decode"]
    assert (pool.target_replicas, pool.num_draining, pool.num_restarts) == (1, 0, 0)  # a drain is not a death


def test_the_prefill_pool_goes_to_zero_and_comes_back(cluster):
    connector = RayConnector()
    with SplitServeClient(cluster.router_status.grpc_address) as client:
        [prompt] = random_prompts([40], seed=3)
        before = [t for r in client.generate(prompt, **GREEDY) for t in r.token_ids]
        asyncio.run(connector.set_replicas("prefill", 0))
        wait_until(lambda: not [r for r in client.cluster_status().replicas if r.pool == "prefill"], 60)
        alone = [t for r in client.generate(prompt, **GREEDY) for t in r.token_ids]  # decode prefills locally
        asyncio.run(connector.set_replicas("prefill", 1))
        assert _pools(connector)["prefill"].starting == 0  # started and in the map on return
        wait_until(lambda: _pools(connector)["prefill"].ready == 1, 30)  # healthy by the controller's last probe
        back = [t for r in client.generate(prompt, **GREEDY) for t in r.token_ids]
    assert before == alone == back


def test_an_unknown_pool_is_a_connector_error_naming_it(cluster):
    from planner.connector import ConnectorError

    with pytest.raises(ConnectorError, match="'gpu' is not one of"):
        asyncio.run(RayConnector().set_replicas("gpu", 1))



def test_planner_profile_measures_the_cluster_into_a_profile_the_planner_loads(cluster, tmp_path, capsys):
    from planner import profile
    from planner.perf_model import load_profile

    out = tmp_path / "profile.json"
    argv = ["--addr", cluster.router_status.grpc_address, "--json", str(out), "--prompt-lengths", "16,200", "--batches", "1,4", "--decode-tokens", "8", "--repeats", "1"]
    assert profile.main(argv) == 0
    model = load_profile(out)
    assert [p[0] for p in model.prefill] == [16, 200] and [p[0] for p in model.decode] == [1, 4]
    assert all(s > 0 for _, s in model.prefill + model.decode)
    assert "prefill of 200 tokens" in capsys.readouterr().err  # a progress line per measurement


def test_planner_profile_of_a_router_that_is_not_there_is_one_sentence(tmp_path, capsys):
    from planner import profile

    assert profile.main(["--addr", "127.0.0.1:1", "--json", str(tmp_path / "p.json"), "--repeats", "1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m planner.profile: the router at 127.0.0.1:1 answered UNAVAILABLE")
