"""Mutual TLS inside the cluster, on real clusters: the request plane between the router and the
decode worker (a cluster in this session's Ray), and Ray's own gRPC (control calls, KV events) in a
``splitserve up`` of its own, since Ray takes its TLS settings once per process."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys

import psutil
import pytest
import ray

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb
from proto.framing import frame
from proto.tls import ClusterTLSConfig, client_context, ray_tls_env
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.certs import make_pki
from tests.integration.conftest import running_cluster
from tests.integration.test_cli import CLI, _lines, _wait_for
from tests.redis_server import free_port
from tests.unit.engine.helpers import random_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster_tls(pki):
    return ClusterTLSConfig(pki.node_cert, pki.node_key, pki.ca_cert)


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir):
    return EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def cluster(ray_session, engine_config, cluster_tls):
    config = ClusterConfig(engine=engine_config, worker=WorkerConfig(cluster_tls=cluster_tls), router=RouterConfig(port=0, cluster_tls=cluster_tls))
    with running_cluster(config) as c:
        yield c


def bytes_until_closed(sock: socket.socket) -> bytes:
    """What the peer sent before it closed. A peer that closes with our bytes still unread in its
    buffer resets the connection instead of a clean FIN; either way it is closed."""
    received = b""
    try:
        while chunk := sock.recv(1024):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def decode_handle(cluster):
    [(_, _, handle)] = ray.get(cluster.controller.replicas.remote())
    return handle


def test_generate_streams_over_the_tls_request_plane(cluster, engine_config):
    [prompt] = random_prompts([21], seed=31)
    [expected] = LLMEngine(engine_config).generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    with SplitServeClient(cluster.router_status.grpc_address) as client:
        responses = list(client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True, timeout_s=60))
    assert [t for r in responses for t in r.token_ids] == list(expected.output_token_ids)
    assert "".join(r.text for r in responses) == expected.text
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    stats = ray.get(decode_handle(cluster).request_plane_stats.remote())
    assert (stats.num_channels_opened, stats.num_channels_refused, stats.num_submitted) == (1, 0, 1)


def test_the_worker_refuses_a_plain_tcp_client_with_the_right_token(cluster):
    worker = decode_handle(cluster)
    endpoint = ray.get(worker.request_plane.remote())
    before = ray.get(worker.request_plane_stats.remote())
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as plain:
        plain.sendall(frame(wpb.RouterMessage(open=wpb.OpenChannel(channel_id="intruder", token=endpoint.token))))
        plain.sendall(frame(wpb.RouterMessage(submit=wpb.Submit(request=pb.GenerateRequest(request_id="x", prompt="hi")))))
        assert bytes_until_closed(plain) == b""  # closed without a byte
    after = ray.get(worker.request_plane_stats.remote())
    assert after.num_channels_refused == before.num_channels_refused + 1
    assert (after.num_submitted, after.num_channels_opened) == (before.num_submitted, before.num_channels_opened)
    with SplitServeClient(cluster.router_status.grpc_address) as client:  # the router's own channel still serves
        assert sum(len(r.token_ids) for r in client.generate("hello", max_tokens=3, ignore_eos=True, timeout_s=60)) == 3


def test_a_cluster_needs_tls_at_both_ends_of_the_request_plane(cluster_tls):
    with pytest.raises(ValueError, match=r"^worker.cluster_tls: set it together with router.cluster_tls"):
        ClusterConfig(worker=WorkerConfig(cluster_tls=cluster_tls), router=RouterConfig())


def test_init_ray_refuses_to_start_ray_without_its_tls_environment(cluster_tls):
    code = (
        "import sys; from pathlib import Path; from proto.tls import ClusterTLSConfig; from router.control.launch import init_ray;"
        "init_ray(None, ClusterTLSConfig(*map(Path, sys.argv[1:])))"
    )
    files = [str(cluster_tls.cert_file), str(cluster_tls.key_file), str(cluster_tls.ca_file)]
    env = {k: v for k, v in os.environ.items() if k not in ray_tls_env(cluster_tls)}
    result = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ValueError: cluster_tls: Ray reads its TLS settings when a process imports it; start this process with "
        + " ".join(f"{k}={v}" for k, v in ray_tls_env(cluster_tls).items())
    )


def test_up_refuses_half_a_cluster_tls_setting(pki):
    result = subprocess.run(CLI + ["up", "--cluster-tls-cert", str(pki.node_cert)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "splitserve up: cluster_tls: --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together"


def _gcs_port(up_pid: int) -> int:
    [gcs] = [p for p in psutil.Process(up_pid).children(recursive=True) if p.name() == "gcs_server"]
    [port] = [c.laddr.port for c in gcs.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    return port


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""The first bytes of every HTTP/2 (so gRPC) client; a server answers with a SETTINGS frame."""


def _first_frame_over_tls(port: int, context: ssl.SSLContext) -> bytes:
    """The header of the first HTTP/2 frame 127.0.0.1:port sends a TLS client with ``context``."""
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        tls.sendall(H2_PREFACE)
        try:
            return tls.recv(9)
        except ConnectionResetError:  # refused with our preface unread: closed all the same
            return b""


@pytest.mark.slow
def test_up_with_cluster_tls_runs_ray_over_tls_and_serves(pki, cluster_tls, tiny_llama_dir):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TLS") and k != "RAY_USE_TLS"} | {"RAY_ADDRESS": ""}
    tls_flags = ["--cluster-tls-cert", str(pki.node_cert), "--cluster-tls-key", str(pki.node_key), "--cluster-tls-ca", str(pki.ca_cert)]
    up = subprocess.Popen(
        CLI + ["up", "--port", str(port), "--prefill", "1", "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--num-kv-blocks", "64", *tls_flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        lines = _lines(up.stdout)
        _wait_for(lines, "try: splitserve generate", timeout_s=180)
        assert psutil.Process(up.pid).environ()["RAY_USE_TLS"] == "1"  # it restarted itself with Ray's TLS settings
        with SplitServeClient(f"127.0.0.1:{port}") as client:  # the public API: plaintext, as configured
            responses = list(client.generate("hello", max_tokens=5, ignore_eos=True, timeout_s=60))
        assert sum(len(r.token_ids) for r in responses) == 5

        gcs_port = _gcs_port(up.pid)
        settings = _first_frame_over_tls(gcs_port, client_context(cluster_tls))
        assert settings[3] == 0x4  # a SETTINGS frame: Ray's GCS speaks gRPC over TLS to a cluster member
        stranger = ClusterTLSConfig(pki.other_node_cert, pki.other_node_key, pki.ca_cert)
        no_cert = ssl.create_default_context(cafile=pki.ca_cert)
        no_cert.check_hostname = False
        for refused in (client_context(stranger), no_cert):  # closed without a byte
            assert _first_frame_over_tls(gcs_port, refused) == b""
        with socket.create_connection(("127.0.0.1", gcs_port), timeout=10) as plain:
            plain.sendall(H2_PREFACE)  # a plaintext gRPC client
            assert bytes_until_closed(plain) == b""

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=120) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
