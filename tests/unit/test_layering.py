"""The arrows of DESIGN.md and README.md's layout: which package may import which, and which of
router/'s rooms may import which, checked on the source. The layering is written once, here, as data."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "kv_store", "kv_transfer", "engine", "prefill_worker", "decode_worker", "router", "planner", "cli")
KNOWN = (*PACKAGES, "bench", "tests")
"""Every first-party top-level name; bench/ and tests/ sit above everything and no package imports them."""
ALLOWED = {
    "proto": {"proto"},
    "kv_store": {"kv_store"},
    "kv_transfer": {"kv_transfer", "kv_store"},
    "engine": {"engine", "kv_store"},
    "prefill_worker": {"prefill_worker", "engine", "kv_transfer", "kv_store", "proto"},
    "decode_worker": {"decode_worker", "engine", "kv_transfer", "kv_store", "proto"},
    "router": {"router", "proto", "kv_store"},
    "planner": {"planner", "router", "proto", "kv_store"},
    # The `splitserve` command sits above every room it drives, and no room imports it.
    "cli": {"cli", "planner", "router", "proto", "kv_store", "engine", "prefill_worker", "decode_worker", "kv_transfer"},
}
ROUTER_LAYERS = (
    ("router", "router.config", "router.errors", "router.client"),
    ("router.routing",),
    ("router.frontend",),
    ("router.replica",),
    ("router.control",),
)
"""router/'s rooms, lowest first: a module may import its own layer's modules and those below, never
above (the control plane starts router actors, which serve a front end over a routing policy)."""
COMPOSITION_ROOTS = {
    # The launcher builds the workers' typed configs (no torch behind them) and name
    # the worker actor class by import path; nothing else in the router touches worker code.
    "router/control/launch.py": {"engine.config", "decode_worker.config", "prefill_worker.config"},
    # The router tokenizes with the workers' own Tokenizer (no torch behind it), built from files
    # a decode worker hands it, so the ids are the ones the engine would make.
    "router/routing/tokenization.py": {"engine.tokenizer", "engine.errors"},
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in KNOWN}


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_arrows(package):
    violations = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        allowed_modules = COMPOSITION_ROOTS.get(rel, set())
        for name in _imports(path):
            if name.split(".")[0] not in ALLOWED[package] and name not in allowed_modules:
                violations.append(f"{rel} imports {name}")
    assert violations == []


def test_key_spec_and_configs_stay_light():
    for rel in ("kv_store/keys.py", "engine/config.py", "engine/cpus.py", "decode_worker/config.py", "prefill_worker/config.py"):
        tree = ast.parse((REPO / rel).read_text())
        every_import = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        every_import |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(name.split(".")[0] == "torch" for name in every_import), rel
        assert _imports(REPO / rel) <= {"kv_store.keys", "kv_store._chain", "engine.config", "engine.cpus", "proto.tls"}, rel


def test_the_worker_actor_modules_import_no_torch():
    """The controller imports the actor classes by path to create the replicas: torch there would
    cost every cluster start about 2.7 CPU-s. The engine loads in the replica's own process."""
    code = "import sys, decode_worker.actor, prefill_worker.actor, router.control.controller; print(sorted(m for m in ('torch', 'nixl') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _router_layer(module: str) -> int:
    """The index in ROUTER_LAYERS of the longest prefix of ``module`` it names."""
    best = max(((len(prefix), layer) for layer, prefixes in enumerate(ROUTER_LAYERS) for prefix in prefixes if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer of ROUTER_LAYERS"
    return best[1]


def test_router_rooms_import_only_their_own_layer_and_below():
    upward = []
    for path in sorted((REPO / "router").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        layer = _router_layer(module)
        for name in _imports(path):
            if name.split(".")[0] == "router" and _router_layer(name) > layer:
                upward.append(f"{module} imports {name}")
    assert upward == []


def test_router_keeps_at_most_six_modules_at_its_top():
    assert len(list((REPO / "router").glob("*.py"))) <= 6


def test_no_bench_file_runs_over_500_lines():
    """A benchmark that outgrows a file splits into modules (bench/planner_sets.py from planner_traces.py)."""
    long = {path.name: n for path in sorted((REPO / "bench").glob("*.py")) if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}
