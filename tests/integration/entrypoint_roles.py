"""Entrypoint processes (`splitserve head|worker|router`) run as the pods run them, for the tests
that start Ray nodes of their own: each node's ports, one process per role, and cleanup."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import psutil
import pytest

from tests.redis_server import free_port

CLI = [sys.executable, "-m", "cli.main"]
PORT_FLAGS = (
    "--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port",
    "--metrics-export-port", "--runtime-env-agent-port",
)


def ray_start_args(*extra: str) -> str:
    """``ray start`` options of one node. Every port of its own, given up front: with port 0 the
    raylet waits for each agent to write the port it took (on a busy 2-core machine a dashboard
    agent outlasted that wait and took the node down), and two nodes starting at once on one
    host raced for the same one. No log monitor (nothing reads worker logs here) and the smallest
    useful object store (100 MB): three nodes on one small machine."""
    ports = [f"{flag} {free_port()}" for flag in PORT_FLAGS]
    return " ".join([*ports, "--include-log-monitor false", "--object-store-memory 100000000", *extra])


class Role:
    """One entrypoint process: its output lines and the processes it started."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        env = {**os.environ, "RAY_ADDRESS": "", **(env or {})}  # never the address of another Ray on this host
        self.process = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()

    def wait_for(self, needle: str, timeout_s: float) -> str:
        """The first line (from now on) containing ``needle``."""
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"{self.name}: no line containing {needle!r} within {timeout_s} s; last lines: {self.seen[-15:]}") from None
            self.seen.append(line)
            if needle in line:
                return line

    def drain_output(self) -> list[str]:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.seen

    def tree(self) -> list[psutil.Process]:
        """This process and every process below it (its Ray node and that node's workers)."""
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout_s} s of SIGTERM; last lines: {self.drain_output()[-15:]}") from None


def kill_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


@pytest.fixture
def ray_temp_dir():
    """A short temp dir of this cluster's own (Ray's socket paths must stay under 108 characters)."""
    path = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
