"""Regenerate the committed protobuf/gRPC code: ``python -m proto.generate [OUT_DIR]``.

Run from the repository root with the pinned grpcio-tools. tests/unit/proto checks that the
committed files equal a fresh generation, so edit the .proto files, never the output.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_FILES = ("proto/splitserve.proto", "proto/worker.proto")
HEADER = "# DO NOT EDIT: generated from {source} by grpcio-tools {version} (python -m proto.generate).\n"


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under ``out_root/proto`` and return their paths."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{repo}", f"-I{Path(protoc.__file__).parent / '_proto'}"]
        args += [f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main(args + [str(repo / p) for p in PROTO_FILES]) != 0:
            raise RuntimeError("protoc failed")
        version = importlib.metadata.version("grpcio-tools")
        written = []
        for path in sorted(Path(tmp, "proto").iterdir()):
            source = "proto/" + path.name.split("_pb2")[0] + ".proto"
            dest = out_root / "proto" / path.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(HEADER.format(source=source, version=version) + path.read_text())
            written.append(dest)
        return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    for p in generate(out):
        print(p)
    shutil.rmtree(Path(out) / "proto" / "__pycache__", ignore_errors=True)
