"""Issue a cluster node's certificate from the cluster CA, on the node, when it starts.

Ray's own gRPC checks the server's certificate against the address it dials (a node's IP, the
head's Service name), so one certificate shared by every pod cannot serve: each Ray node needs
one naming its own address, which a pod knows only once it runs. ``splitserve node-cert`` runs as
the pod's init container: it makes a fresh key, signs a certificate for the pod's IP (and DNS
names) with the cluster CA's key, and writes ``tls.crt``, ``tls.key`` and ``ca.crt`` where the
node's ``--cluster-tls-*`` options read them. The same certificate serves the request plane
(``proto/tls.py``), whose ends check only the CA's signature.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_FILE, KEY_FILE, CA_FILE = "tls.crt", "tls.key", "ca.crt"
"""The names written into the output directory (those of a kubernetes.io/tls Secret)."""


def issue_node_cert(ca_cert_file: Path, ca_key_file: Path, out_dir: Path, ips: Sequence[str], dns_names: Sequence[str] = (), days: int = 365) -> Path:
    """Write a node certificate for ``ips`` and ``dns_names`` signed by the CA into ``out_dir``;
    its path. ValueError naming the problem for an unreadable CA, a key that is not the CA's,
    an address that is not an IP, or no name at all."""
    if not ips and not dns_names:
        raise ValueError("node-cert: give at least one --ip or --dns name for the certificate to cover")
    addresses = []
    for ip in ips:
        try:
            addresses.append(ipaddress.ip_address(ip))
        except ValueError:
            raise ValueError(f"--ip: {ip!r} is not an IP address") from None
    if days < 1:
        raise ValueError(f"--days: must be >= 1, got {days}")
    ca_cert, ca_key = _load_ca(Path(ca_cert_file), Path(ca_key_file))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    san = [x509.IPAddress(a) for a in addresses] + [x509.DNSName(n) for n in dns_names]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (list(dns_names) + list(ips))[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # nodes' clocks differ a little
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / KEY_FILE, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600)
    _write(out_dir / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(out_dir / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out_dir / CERT_FILE


def _load_ca(cert_file: Path, key_file: Path):
    try:
        ca_cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"--ca-cert: {cert_file} is not a readable PEM certificate ({e})") from None
    try:
        ca_key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--ca-key: {key_file} is not a readable, unencrypted PEM private key ({e})") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if ca_key.public_key().public_bytes(*spki) != ca_cert.public_key().public_bytes(*spki):
        raise ValueError(f"--ca-key: {key_file} is not the key of the CA certificate {cert_file}")
    return ca_cert, ca_key


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write atomically, with ``mode`` from the start (a key is never readable by others, even briefly)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
