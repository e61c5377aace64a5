"""`splitserve node-cert`: a node's certificate issued from the cluster CA, as a pod's init container does."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cli.main import main
from proto.node_cert import issue_node_cert
from proto.tls import ClusterTLSConfig, client_context, server_context
from tests.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_the_certificate_names_the_node_serves_both_roles_and_chains_to_the_cluster_ca(pki, tmp_path):
    cert_file = issue_node_cert(pki.ca_cert, pki.ca_key, tmp_path, ips=["10.4.2.17"], dns_names=["splitserve-head-svc.llm.svc.cluster.local"])
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.4.2.17")]
    assert san.get_values_for_type(x509.DNSName) == ["splitserve-head-svc.llm.svc.cluster.local"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600
    assert (tmp_path / "ca.crt").read_bytes() == pki.ca_cert.read_bytes()
    # What the node's --cluster-tls-* options load; the CA verifies the issued chain.
    config = ClusterTLSConfig(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    server_context(config), client_context(config)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()))


def test_bad_input_exits_2_with_a_sentence(pki, tmp_path, capsys):
    args = ["node-cert", "--ca-cert", str(pki.ca_cert), "--out", str(tmp_path / "out")]
    assert main([*args, "--ca-key", str(pki.node_key), "--ip", "10.0.0.1"]) == 2
    assert f"--ca-key: {pki.node_key} is not the key of the CA certificate" in capsys.readouterr().err
    assert main([*args, "--ca-key", str(pki.ca_key), "--ip", "pod-ip"]) == 2
    assert "--ip: 'pod-ip' is not an IP address" in capsys.readouterr().err
    assert main([*args, "--ca-key", str(pki.ca_key)]) == 2
    assert "give at least one --ip or --dns name" in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing is written when the input is bad"
    assert main([*args, "--ca-key", str(pki.ca_key), "--ip", "10.0.0.1"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
