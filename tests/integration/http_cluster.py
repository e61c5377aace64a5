"""The cluster both front-end test modules drive (OpenAI HTTP, KServe v2): one router with gRPC
and HTTP on free ports over the tiny model. Import the fixtures into a test module; each module
gets its own cluster (module scope)."""

from __future__ import annotations

import pytest

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    config = ClusterConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_model_len=512),
        worker=WorkerConfig(max_waiting_requests=8),
        router=RouterConfig(port=0, http_port=0, worker_refresh_interval_s=0.25),
    )
    with running_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def http_address(cluster) -> str:
    """host:port of router-0's HTTP API, as its status reports it."""
    return cluster.router_status.http_url.removeprefix("http://")


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


@pytest.fixture(scope="module")
def model(grpc_client) -> str:
    [info] = grpc_client.list_models()
    return info.id
