"""The request plane with mutual TLS: real sockets on loopback, real certificates (tests/certs.py)."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from decode_worker.request_plane import RequestPlaneServer
from proto import worker_pb2 as wpb
from proto.framing import frame
from proto.tls import ClusterTLSConfig, client_context
from tests.certs import make_pki
from tests.unit.decode_worker.test_request_plane import SILENT_TIMEOUT_S, TOKEN, Requests, next_batch, submit, until


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster_tls(pki):
    return ClusterTLSConfig(pki.node_cert, pki.node_key, pki.ca_cert)


async def serve(requests: Requests, tls: ClusterTLSConfig, open_timeout_s: float = 10.0) -> tuple[RequestPlaneServer, wpb.RequestPlaneEndpoint]:
    """A TLS server; 10 s for a handshake, so that on a busy machine a slow one still ends in the
    verdict a test expects (a certificate refused, a channel opened), never in a timeout."""
    server = RequestPlaneServer("decode-t", TOKEN, requests, open_timeout_s=open_timeout_s, tls=tls)
    return server, await server.start("127.0.0.1", 0)


async def connect(endpoint, ssl_context: ssl.SSLContext | None):
    """Opens a channel as a router does: TLS (if a context is given), then the token."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=ssl_context)
    writer.write(frame(wpb.RouterMessage(open=wpb.OpenChannel(channel_id="router-0", token=TOKEN))))
    return reader, writer


async def serves_one_request(requests: Requests, endpoint, tls: ClusterTLSConfig, request_id: str) -> None:
    reader, writer = await connect(endpoint, client_context(tls))
    assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
    submit(writer, request_id)
    await until(lambda: request_id in requests.started)
    await requests.step()
    [event] = (await next_batch(reader)).events
    assert (event.request_id, list(event.response.token_ids)) == (request_id, [0])
    writer.close()


def refusals(caplog) -> list[str]:
    return [r.getMessage().split(": ", 2)[-1] for r in caplog.records if "refused a connection" in r.getMessage()]


def test_a_router_with_the_cluster_certificate_is_served(cluster_tls):
    async def main():
        requests = Requests(num_tokens=1)
        server, endpoint = await serve(requests, cluster_tls)
        await serves_one_request(requests, endpoint, cluster_tls, "a")
        assert server.stats.num_channels_opened == 1 and server.stats.num_channels_refused == 0
        server.close()

    asyncio.run(main())


def test_a_plain_tcp_client_is_refused_and_the_next_router_is_served(cluster_tls, caplog):
    async def main():
        requests = Requests(num_tokens=1)
        server, endpoint = await serve(requests, cluster_tls)
        reader, writer = await connect(endpoint, None)  # the right token, in the clear
        submit(writer, "plain")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a byte
        assert server.stats.num_channels_refused == 1 and server.stats.num_channels_opened == 0
        assert server.stats.num_submitted == 0 and requests.started == []
        await serves_one_request(requests, endpoint, cluster_tls, "good")
        assert requests.started == ["good"] and server.stats.num_channels_opened == 1
        server.close()
        impatient, endpoint = await serve(requests, cluster_tls, SILENT_TIMEOUT_S)
        reader, _ = await asyncio.open_connection(endpoint.host, endpoint.port)  # says nothing
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert impatient.stats.num_channels_refused == 1 and impatient.stats.num_channels_opened == 0
        impatient.close()

    asyncio.run(main())
    plain, silent = refusals(caplog)
    assert plain.startswith("TLS handshake failed: [SSL: ") and "(_ssl.c" in plain  # bytes that are no TLS record
    assert silent == f"no TLS handshake: ConnectionAbortedError('SSL handshake is taking longer than {SILENT_TIMEOUT_S} seconds: aborting the connection')"


def test_a_certificate_from_another_ca_or_none_is_refused(pki, cluster_tls, caplog):
    async def main():
        requests = Requests(num_tokens=1)
        server, endpoint = await serve(requests, cluster_tls)
        stranger = client_context(ClusterTLSConfig(pki.other_node_cert, pki.other_node_key, pki.ca_cert))
        no_cert = ssl.create_default_context(cafile=pki.ca_cert)
        no_cert.check_hostname = False
        for context in (stranger, no_cert):
            reader, writer = await connect(endpoint, context)  # TLS 1.3: the server judges the client after the client's side is done
            submit(writer, "stranger")
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        assert server.stats.num_channels_refused == 2 and server.stats.num_submitted == 0
        await serves_one_request(requests, endpoint, cluster_tls, "good")
        assert requests.started == ["good"]
        server.close()

    asyncio.run(main())
    assert [r.split(" (_ssl.c")[0] for r in refusals(caplog)] == [
        "TLS handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate",
        "TLS handshake failed: [SSL: PEER_DID_NOT_RETURN_A_CERTIFICATE] peer did not return a certificate",
    ]


def test_a_router_refuses_a_worker_whose_certificate_another_ca_signed(pki, cluster_tls):
    async def main():
        requests = Requests(num_tokens=1)
        impostor = ClusterTLSConfig(pki.other_node_cert, pki.other_node_key, pki.other_ca_cert)
        server, endpoint = await serve(requests, impostor)
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            await connect(endpoint, client_context(cluster_tls))
        await until(lambda: server.stats.num_channels_refused == 1)
        assert server.stats.num_submitted == 0
        server.close()

    asyncio.run(main())


def test_the_config_names_a_bad_field(pki, tmp_path):
    with pytest.raises(ValueError, match=r"^cert_file: .*missing.pem is not a file$"):
        ClusterTLSConfig(tmp_path / "missing.pem", pki.node_key, pki.ca_cert)
    with pytest.raises(ValueError, match=r"^key_file: .*client-key.pem is not the key of cert_file"):
        ClusterTLSConfig(pki.node_cert, pki.client_key, pki.ca_cert)
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(ValueError, match=r"^ca_file: .*empty.pem holds no PEM certificate"):
        ClusterTLSConfig(pki.node_cert, pki.node_key, tmp_path / "empty.pem")
