"""Mutual TLS inside the cluster: the request plane (routers <-> decode workers) and Ray's own gRPC.

Every member holds one certificate signed by the cluster CA, good for both serverAuth and
clientAuth, and accepts only peers whose certificate that CA signed::

    router (client_context)                      decode worker (server_context)
    presents cert_file ──── TLS handshake ─────> requires a client certificate from ca_file's CA
    verifies the worker's against ca_file <───── presents cert_file

A peer is a cluster member because the cluster CA signed it; host names are not checked (workers
listen on whatever address their node has, and the channel token, handed out over Ray, already
binds a connection to one worker). Like the framing beside it, this is part of the wire: both
ends import it from here.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClusterTLSConfig:
    """The certificate this cluster member presents and the CA every peer's must come from."""

    cert_file: Path
    """PEM certificate (chain) of this member, for serverAuth and clientAuth, signed by the cluster CA."""
    key_file: Path
    """PEM private key of cert_file."""
    ca_file: Path
    """PEM cluster CA: a peer whose certificate it did not sign is refused."""

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is None or not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a file")
        try:
            ssl.create_default_context().load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            raise ValueError(f"key_file: {self.key_file} is not the key of cert_file {self.cert_file} ({e})") from None
        try:
            ssl.create_default_context(cafile=self.ca_file)
        except ssl.SSLError as e:
            raise ValueError(f"ca_file: {self.ca_file} holds no PEM certificate ({e})") from None


def server_context(config: ClusterTLSConfig) -> ssl.SSLContext:
    """For the accepting end: presents cert_file and requires a client certificate from ca_file's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.cert_file, config.key_file)
    context.load_verify_locations(cafile=config.ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(config: ClusterTLSConfig) -> ssl.SSLContext:
    """For the connecting end: presents cert_file and accepts only a server certificate from ca_file's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # membership is the CA's signature (see the module docstring)
    context.load_cert_chain(config.cert_file, config.key_file)
    context.load_verify_locations(cafile=config.ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def ray_tls_env(config: ClusterTLSConfig) -> dict[str, str]:
    """The environment that makes Ray's own gRPC (GCS, raylets, workers: control calls, KV events)
    use mutual TLS with this certificate. Ray reads it once, when a process imports ``ray``, so it
    must be set before that, in every Ray process of every node."""
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(Path(config.cert_file).resolve()),
        "RAY_TLS_SERVER_KEY": str(Path(config.key_file).resolve()),
        "RAY_TLS_CA_CERT": str(Path(config.ca_file).resolve()),
    }
