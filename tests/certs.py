"""Throwaway PKI for TLS tests: a CA, a server certificate for localhost, a client certificate,
and cluster node certificates (both roles, as the request plane and Ray's TLS use them)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TestPKI:
    ca_cert: Path
    ca_key: Path
    """The CA's private key: ``splitserve node-cert`` signs node certificates with it."""
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path
    """A CA that signed only ``other_node_*``: trusting it must fail for everything else."""
    node_cert: Path
    """Signed by ``ca_cert`` for serverAuth and clientAuth: one cluster member's certificate."""
    node_key: Path
    other_node_cert: Path
    """Like ``node_cert`` but signed by ``other_ca_cert``: a peer from another cluster."""
    other_node_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, usage=None, san=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(out: Path) -> TestPKI:
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for ca_name in ("ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"splitserve test {ca_name}", key, _name(f"splitserve test {ca_name}"), key, ca=True)
        (out / f"{ca_name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out / f"{ca_name}-key.pem")
        paths[ca_name] = (cert, key)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    leaves = (
        ("server", "ca", [ExtendedKeyUsageOID.SERVER_AUTH]),
        ("client", "ca", [ExtendedKeyUsageOID.CLIENT_AUTH]),
        ("node", "ca", both),
        ("other-node", "other-ca", both),
    )
    for role, issuer, usage in leaves:
        issuer_cert, issuer_key = paths[issuer]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"splitserve test {role}", key, issuer_cert.subject, issuer_key, ca=False, usage=usage, san=san)
        (out / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out / f"{role}-key.pem")
    return TestPKI(
        ca_cert=out / "ca.pem",
        ca_key=out / "ca-key.pem",
        server_cert=out / "server.pem",
        server_key=out / "server-key.pem",
        client_cert=out / "client.pem",
        client_key=out / "client-key.pem",
        other_ca_cert=out / "other-ca.pem",
        node_cert=out / "node.pem",
        node_key=out / "node-key.pem",
        other_node_cert=out / "other-node.pem",
        other_node_key=out / "other-node-key.pem",
    )
