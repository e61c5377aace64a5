"""`splitserve up` / `generate` / `status` as a user runs them, with the bundled SmolLM2."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-m", "cli.main"]


def _lines(stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def _wait_for(lines: queue.Queue, needle: str, timeout_s: float) -> list[str]:
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line containing {needle!r} within {timeout_s} s; got {seen}") from None
        seen.append(line)
        if needle in line:
            return seen


def test_up_serves_the_bundled_model_and_stops_cleanly_on_sigint(smollm2_dir, smollm2_cache_dir):
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": ""}
    up = subprocess.Popen(
        CLI + ["up", "--port", str(port), "--cache-dir", str(smollm2_cache_dir), "--kv-cache-bytes", str(128 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        lines = _lines(up.stdout)
        seen = _wait_for(lines, "try: splitserve generate", timeout_s=180)
        assert any("starting 1 prefill + 1 decode replica(s) of smollm2-135m" in s for s in seen)  # disaggregated by default
        assert any(f"serving gRPC on 127.0.0.1:{port}" in s for s in seen)
        assert f'splitserve generate --addr 127.0.0.1:{port} "What is the capital of France?"' in seen[-1]

        answer = subprocess.run(
            CLI + ["generate", "--addr", f"127.0.0.1:{port}", "What is the capital of France?"],
            capture_output=True, text=True, timeout=120,
        )
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout

        status = subprocess.run(CLI + ["status", "--addr", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        for pool in ("decode", "prefill"):
            [replica_line] = [line for line in status.stdout.splitlines() if line.startswith(pool)]
            assert "smollm2-135m" in replica_line and " true " in replica_line
            assert f"pool {pool}: 1/1 replicas, 0 starting, 0 draining, 0 restarts, 0 failed starts" in status.stdout

        processes = psutil.Process(up.pid).children(recursive=True)
        assert processes, "up should run Ray and worker processes"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=120) == 0
        _wait_for(lines, "splitserve: stopped", timeout_s=5)
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert alive == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_generate_against_nothing_fails_with_a_sentence():
    result = subprocess.run(
        CLI + ["generate", "--addr", f"127.0.0.1:{free_port()}", "--timeout", "5", "hello"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 3
    assert result.stderr.strip().startswith("splitserve: UNAVAILABLE")


def test_up_refuses_a_bad_option_with_a_sentence():
    result = subprocess.run(CLI + ["up", "--kv-dtype", "int3"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "kv_dtype: 'int3' is not one of" in result.stderr


def test_up_joins_an_existing_ray_cluster_and_leaves_it_running(ray_session, tiny_llama_dir):
    import ray

    address = ray.get_runtime_context().gcs_address
    port = free_port()
    up = subprocess.Popen(
        CLI + ["up", "--address", address, "--port", str(port), "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--num-kv-blocks", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = _lines(up.stdout)
        _wait_for(lines, "try: splitserve generate", timeout_s=120)
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert {"splitserve-controller", "splitserve-router-0", "splitserve-decode-0", "splitserve-prefill-0"} <= names
        answer = subprocess.run(
            CLI + ["generate", "--addr", f"127.0.0.1:{port}", "--raw", "--max-tokens", "5", "hello"],
            capture_output=True, text=True, timeout=60,
        )
        assert answer.returncode == 0, answer.stderr
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert ray.is_initialized() and ray.cluster_resources()  # the joined cluster is still up
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not {n for n in names if n.startswith("splitserve-")}
