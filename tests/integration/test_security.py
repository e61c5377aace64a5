"""TLS, mutual TLS and bearer tokens on real router replicas, accepted and refused."""

from __future__ import annotations

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from router.client import SplitServeClient
from router.config import RouterConfig, TLSConfig
from router.control.launch import Cluster, ClusterConfig
from tests.certs import make_pki
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=64)
    with running_cluster(ClusterConfig(engine=engine, worker=WorkerConfig(), router=RouterConfig(port=0))) as c:
        yield c


@pytest.fixture(scope="module")
def start_router(cluster):
    started = []

    def start(router_id: str, config: RouterConfig) -> str:
        router = Cluster.start_router(router_id, config)
        status = ray.get(router.start.remote())
        started.append(router)
        return f"localhost:{status.grpc_address.rsplit(':', 1)[1]}"

    yield start
    for router in started:
        ray.get(router.stop.remote())
        ray.kill(router)


def _answer(client: SplitServeClient) -> int:
    return sum(len(r.token_ids) for r in client.generate("hello", max_tokens=3, ignore_eos=True, timeout_s=30))


def _refused(client: SplitServeClient) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        _answer(client)
    return e.value.code()


def test_tls(start_router, pki):
    address = start_router("router-tls", RouterConfig(port=0, tls=TLSConfig(pki.server_cert, pki.server_key)))
    with SplitServeClient(address, tls_ca_file=pki.ca_cert) as client:
        assert _answer(client) == 3
    with SplitServeClient(address, tls_ca_file=pki.other_ca_cert) as client:
        assert _refused(client) == grpc.StatusCode.UNAVAILABLE
    with SplitServeClient(address) as plaintext:
        assert _refused(plaintext) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(start_router, pki):
    tls = TLSConfig(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
    address = start_router("router-mtls", RouterConfig(port=0, tls=tls))
    with SplitServeClient(address, tls_ca_file=pki.ca_cert, client_cert_file=pki.client_cert, client_key_file=pki.client_key) as client:
        assert _answer(client) == 3
    with SplitServeClient(address, tls_ca_file=pki.ca_cert) as no_cert:
        assert _refused(no_cert) == grpc.StatusCode.UNAVAILABLE


def test_bearer_token(start_router, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    address = start_router("router-token", RouterConfig(port=0, token_file=token_file))
    with SplitServeClient(address, token=TOKEN) as client:
        assert _answer(client) == 3
        assert client.list_models()
    for token in (None, "wrong"):
        with SplitServeClient(address, token=token) as client:
            assert _refused(client) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                client.list_models()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in e.value.details()
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_bad_tls_config_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="cert_file: .*missing.pem is not a file"):
        TLSConfig(tmp_path / "missing.pem", tmp_path / "key.pem")
