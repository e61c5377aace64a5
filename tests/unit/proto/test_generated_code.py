"""The committed generated code is exactly what the pinned grpcio-tools makes from the .proto files."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_committed_code_equals_a_fresh_generation(tmp_path):
    # In a child process: grpc_tools' bundled protobuf runtime and NIXL's native libraries crash
    # when loaded into one process (either order), and the suite imports NIXL.
    subprocess.run([sys.executable, "-m", "proto.generate", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    fresh = {p.name: p.read_text() for p in (tmp_path / "proto").glob("*_pb2*.py*")}
    committed = {p.name: p.read_text() for p in (REPO / "proto").glob("*_pb2*.py*")}
    assert fresh and sorted(fresh) == sorted(committed)
    for name, text in fresh.items():
        assert committed[name] == text, f"proto/{name} differs from a fresh generation: run python -m proto.generate"
        assert text.startswith("# DO NOT EDIT: generated from proto/")
