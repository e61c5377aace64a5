"""RayNode.start against a stand-in for `ray start` (a script that prints what Ray prints): a
raylet that did not register within Ray's fixed 30 s is started again, any other failure is
final, and a node that never came up does not fire ``on_exit``. The real `ray start` runs in
tests/integration/test_entrypoints.py; it cannot be made to miss its registration on demand."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from router.control.ray_node import RAY_START_ATTEMPTS, READY_LINE, REGISTRATION_TIMEOUT, RayNode, RayNodeError

TIMED_OUT = f"Exception: The current node {REGISTRATION_TIMEOUT}. This could happen because some of the raylet failed to startup or the GCS has become overloaded."


def fake_ray_start(tmp_path, failures: list[str]) -> list[str]:
    """A command that fails with ``failures[i]`` on its i-th run, then brings a node up and blocks."""
    script = tmp_path / "fake_ray_start.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, sys, time
        runs = pathlib.Path({str(tmp_path / "runs")!r})
        n = int(runs.read_text()) if runs.exists() else 0
        runs.write_text(str(n + 1))
        failures = {failures!r}
        if n < len(failures):
            print("Local node IP: 127.0.0.1", flush=True)
            print(failures[n], flush=True)
            sys.exit(1)
        print({READY_LINE!r} + ".", flush=True)
        time.sleep(600)
    """))
    return [sys.executable, str(script)]


def runs(tmp_path) -> int:
    return int((tmp_path / "runs").read_text())


def test_a_raylet_that_missed_its_registration_is_started_again(tmp_path, capsys):
    ended = threading.Event()
    node = RayNode(fake_ray_start(tmp_path, [TIMED_OUT, TIMED_OUT]), on_exit=ended.set)
    node.start(timeout_s=60)
    try:
        assert runs(tmp_path) == 3 and node.returncode is None
        assert not ended.is_set()  # the failed tries are not the node ending: its role must not stop
        assert capsys.readouterr().out.count("did not register within Ray's 30 s; starting it again") == 2
    finally:
        node.stop()
    assert not ended.is_set()  # stopped on purpose


def test_registration_missed_on_every_try_is_reported_with_rays_line(tmp_path):
    node = RayNode(fake_ray_start(tmp_path, [TIMED_OUT] * RAY_START_ATTEMPTS))
    with pytest.raises(RayNodeError, match=rf"^ray start failed \(exit code 1\): Exception: The current node {REGISTRATION_TIMEOUT}"):
        node.start(timeout_s=60)
    assert runs(tmp_path) == RAY_START_ATTEMPTS


def test_any_other_failure_is_not_tried_again(tmp_path):
    node = RayNode(fake_ray_start(tmp_path, ["ValueError: --port 99999 is not a port"]))
    with pytest.raises(RayNodeError, match=r"^ray start failed \(exit code 1\): ValueError: --port 99999 is not a port$"):
        node.start(timeout_s=60)
    assert runs(tmp_path) == 1


def test_a_node_that_ends_after_coming_up_fires_on_exit(tmp_path):
    ended = threading.Event()
    node = RayNode(fake_ray_start(tmp_path, []), on_exit=ended.set)
    node.start(timeout_s=60)
    node._process.kill()  # as if Ray's node died under it
    assert ended.wait(10)
    assert node.returncode is not None
