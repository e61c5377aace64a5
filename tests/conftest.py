"""Session-wide test set-up: offline hubs, loopback-only Ray, the gpu marker, tiny checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that find no work sleep instead of spinning. The suite runs many engines at once
# on few cores (replicas of a test cluster, two pytest workers, and whatever else the machine
# runs); a spinning team holds cores its peers need, and one descheduled member stalls the rest at
# every barrier. A matmul loop on 2 threads beside 3 other busy agents: 442 s spinning, 36 s
# sleeping. Set before torch is imported: libgomp reads it once, when it loads. Ray clusters and
# subprocesses the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile is a no-op decorator. Nothing in this repo compiles with it, but llguidance.torch
# (imported by engine/structured/bitmask.py) decorates a kernel that we never call with
# ``@torch.compile`` when it is imported, and that decoration imports TorchInductor: 1.5 to 2.5
# CPU-s in every process that imports the engine (each replica, TP rank, `splitserve` process
# and bench the tests start inherit this). Should the engine ever use torch.compile, its tests
# must unset this.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_models import TINY_CONFIGS, make_tiny_checkpoint, make_tiny_tokenizer  # noqa: E402


if not torch.cuda.is_available():
    # Without CUDA, Triton kernels run in Triton's interpreter (tests/unit/engine/test_triton_attention.py).
    # Triton reads this once, when it is first imported, and transformers imports it on the way
    # (through torch._dynamo) in many test modules, so it is set here, before any is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")


DURATIONS_FILE = Path(__file__).with_name("durations.json")
"""Seconds each test module took in a measured run (``--store-durations`` updates the modules it ran)."""
_UNMEASURED_SLOW_S = 30.0
"""A module missing from the file, with a ``slow`` test: guessed long, so it is not dealt last."""
_UNMEASURED_S = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true", help=f"write each test module's seconds to {DURATIONS_FILE.name}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _distributed(config):
        _longest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _distributed(config: pytest.Config) -> bool:
    """Whether pytest-xdist runs this session (in the controller or in a worker)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or bool(getattr(config.option, "numprocesses", None))


def _longest_modules_first(items: list[pytest.Item]) -> None:
    """Modules go out to the workers longest first, by their seconds in ``durations.json``
    (longest-processing-time-first: whole modules are dealt to whichever worker frees up, and a
    long module dealt last would run alone at the end while the other worker idles). The Makefile
    passes ``--no-loadscope-reorder``, or xdist would re-sort them by their number of tests. Every
    worker and the controller sort the same collection the same way, as xdist requires."""
    measured = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
    slow = {_module_of(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def seconds(module: str) -> float:
        return measured.get(module, _UNMEASURED_SLOW_S if module in slow else _UNMEASURED_S)

    items.sort(key=lambda item: -seconds(_module_of(item.nodeid)))


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under xdist the controller sees every worker's reports here, so it can add them all up."""
    _module_seconds[_module_of(report.nodeid)] = _module_seconds.get(_module_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--store-durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        known = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
        known.update((module, round(seconds, 1)) for module, seconds in _module_seconds.items())
        DURATIONS_FILE.write_text(json.dumps(dict(sorted(known.items(), key=lambda kv: -kv[1])), indent=0) + "\n")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray per pytest process (``ray.init`` costs seconds): the integration tests' clusters
    and the benches run in-process (bench.parallel, bench.moe, bench.chaos) join it."""
    import ray

    from router.control.launch import init_ray

    init_ray(None)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def follower_hosts(ray_session):
    """The FollowerHost actors (tests/integration/parallel_engines.py) that the modules building
    engines of several ranks share (the integration tests' and the benches' run in-process): each
    host process imports torch and the engine once per pytest process, not once per module or
    engine. Started as a module needs more; killed at the end."""
    import ray

    hosts: list = []
    yield hosts
    for host in hosts:
        ray.kill(host)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server on loopback for one test module (flush it where a test needs it empty)."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def keeps_torch_threads():
    """Restores torch's thread count after a test whose code sets it (a bench run in-process)."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir):
    """``tiny_checkpoint(name)``: the directory of a tiny random checkpoint, made once per session."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_tiny_checkpoint(name, tmp_path_factory.mktemp(name), tiny_tokenizer_dir)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tiny_checkpoint):
    return tiny_checkpoint("mixtral")


def _run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory of this whole run: under pytest-xdist each worker's basetemp is a
    ``popen-gwN`` directory inside it, so what is put here is shared by the workers."""
    basetemp = tmp_path_factory.getbasetemp()
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A model cache private to this test run, so conversion itself is exercised every run."""
    return _run_root(tmp_path_factory) / "splitserve-cache"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache_dir):
    """The bundled SmolLM2-135M, converted from its GGUF once per run: the first worker to get
    here converts it while the others wait on the lock, then they all find it converted."""
    from filelock import FileLock

    from engine.bundled import resolve_model

    smollm2_cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(smollm2_cache_dir / ".convert.lock"):
        return resolve_model("smollm2-135m", cache_dir=smollm2_cache_dir)


__all__ = ["TINY_CONFIGS"]
