"""init_ray's one second start of a local Ray whose GCS never wrote its port file (ray.init is faked:
the failure is Ray's, rare and slow to provoke)."""

import logging

import pytest

from router.control import launch


@pytest.fixture
def fake_ray(monkeypatch):
    calls = {"init": [], "shutdown": 0, "failures": []}

    def init(**kwargs):
        calls["init"].append(kwargs)
        if calls["failures"]:
            raise calls["failures"].pop(0)

    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", init)
    monkeypatch.setattr(launch.ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    return calls


def test_a_gcs_that_left_no_port_file_gets_one_more_start(fake_ray, caplog):
    fake_ray["failures"].append(RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"))
    with caplog.at_level(logging.WARNING, logger="router.control.launch"):
        launch.init_ray(None)
    assert len(fake_ray["init"]) == 2 and fake_ray["init"][0] == fake_ray["init"][1]
    assert fake_ray["init"][1]["address"] == "local" and fake_ray["shutdown"] == 1
    assert "starting a local Ray again" in caplog.text


def test_a_second_timeout_or_any_other_failure_is_raised(fake_ray):
    timeout = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")
    fake_ray["failures"].extend([timeout, timeout])
    with pytest.raises(RuntimeError, match="Timed out waiting for file"):
        launch.init_ray(None)
    assert len(fake_ray["init"]) == 2
    fake_ray["init"].clear()
    fake_ray["failures"].append(RuntimeError("Failed to start the dashboard"))
    with pytest.raises(RuntimeError, match="dashboard"):
        launch.init_ray(None)
    assert len(fake_ray["init"]) == 1
