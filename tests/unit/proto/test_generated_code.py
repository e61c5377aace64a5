"""The committed generated code is exactly what the pinned grpcio-tools makes from the .proto files."""

from pathlib import Path

from proto.generate import generate

REPO = Path(__file__).resolve().parents[3]


def test_committed_code_equals_a_fresh_generation(tmp_path):
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (REPO / "proto").glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed)
    for name, text in fresh.items():
        assert committed[name] == text, f"proto/{name} differs from a fresh generation: run python -m proto.generate"
        assert text.startswith("# DO NOT EDIT: generated from proto/")
