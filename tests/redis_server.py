"""A real redis-server on a free loopback port, started and stopped by tests."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


_HANDED_OUT: set[int] = set()
"""Ports free_port returned in this process: a test often takes several before binding any (one
Ray head's eight), and a random pick may repeat one still unbound (a head got the same port for
its GCS and its dashboard agent, and Ray refused to start)."""


def free_port() -> int:
    """A loopback port nothing listens on, between Ray's worker ports (10002-19999) and the
    kernel's ephemeral range: no outgoing connection (Ray, gRPC, Redis clients) can be given it
    between now and the moment a test's server binds it. Never one this process was given before."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20_000, max(20_001, ephemeral_low))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port between 20000 and the ephemeral range")


class RedisServer:
    """``redis-server`` in ``workdir`` on 127.0.0.1; ``stop``/``start`` keep the port (the data is lost)."""

    def __init__(self, workdir: Path, password: str | None = None, tls: tuple[Path, Path, Path] | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed: run `make test` (it installs Debian's redis-server)")
        self.workdir = workdir
        self.password = password
        self.tls = tls
        """(cert, key, ca) to serve TLS only (rediss://)."""
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            args += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def client(self, **kwargs) -> redis.Redis:
        if self.tls:
            kwargs.setdefault("ssl_ca_certs", str(self.tls[2]))
        return redis.Redis.from_url(self.url, **kwargs)
