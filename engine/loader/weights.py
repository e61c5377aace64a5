"""Load a Hugging Face safetensors checkpoint into a DecoderModel, and fingerprint its weights.

Checkpoint names are mapped onto our fused parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj, per-expert tensors -> stacked w13/w2). Every parameter must be filled completely;
a missing or unexpected tensor is an error that names it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from engine.errors import CheckpointError, UnsupportedModelError
from engine.models.decoder import DecoderModel

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor lands: a parameter, and which part of it.

    A layer that is split or fused (``engine/parallel/layers.py``) says itself where a named
    ``part`` (q, k, v, gate, up) goes and which slice of the tensor its rank holds; for the
    stacked experts of a MoE block, ``expert`` and the rows of its fused parameter say it.
    """

    param: str
    part: str | None = None
    expert: int | None = None
    row_start: int = 0
    num_rows: int | None = None
    """Rows of a stacked expert parameter this tensor fills; None for the whole of it."""


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The checkpoint's weight files, from the index when there is one."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [checkpoint_dir / n for n in names]
    else:
        files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint_dir}: no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{checkpoint_dir}: weight file {f.name} listed in the index is missing")
    return files


def iter_checkpoint(checkpoint_dir: Path) -> Iterator[tuple[str, object]]:
    """``(name, slice)`` of every tensor; indexing a slice reads only the bytes it selects."""
    for path in safetensors_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e


def weights_fingerprint(checkpoint_dir: Path, precision: str = "") -> str:
    """A 128-bit hex digest of the weights: headers, sizes and evenly spaced samples of every file.

    Reads about 1 MiB per file, so it is cheap for large checkpoints while still telling apart
    two checkpoints of the same shape (fine-tunes, quantizations). ``precision`` says how the
    engine computes with them (model dtype, weights format): the same file run as int4 or as
    fp32 writes different K/V, so those engines must not share blocks.
    """
    h = xxhash.xxh3_128()
    if precision:
        h.update(f"precision:{precision}\n".encode())
    for path in safetensors_files(checkpoint_dir):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            for i in range(_SAMPLES_PER_FILE):
                f.seek(max(0, (size - _SAMPLE_BYTES) * i // max(1, _SAMPLES_PER_FILE - 1)))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def load_weights(model: DecoderModel, checkpoint_dir: Path, skip: frozenset[str] = frozenset()) -> None:
    """Fill every parameter of ``model`` from the checkpoint (cast to the model's dtype).

    A tensor-parallel rank's model reads only its slices of each tensor, a pipeline stage's only
    the tensors of what it holds (``DecoderModel.holds_tensor``). ``skip`` names
    checkpoint tensors not to read at all: those whose layer already holds its weight in another
    form (native GGUF blocks, ``engine/quant/apply.py``) and no longer has the dense parameter.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    filled = {name: 0 for name in params}
    unexpected: list[str] = []
    for name, source in iter_checkpoint(checkpoint_dir):
        if _IGNORED.match(name) or name in skip or not model.holds_tensor(name):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        target = _target(name, model)
        if target is None or target.param not in params:
            unexpected.append(name)
            continue
        for dest, index in _slices(model, target, params[target.param], source.get_shape()):
            tensor = source[index]
            if dest.shape != tensor.shape:
                raise CheckpointError(f"{name}: shape {tuple(source.get_shape())} does not fit {target.param} (slice {tuple(dest.shape)})")
            dest.copy_(tensor)
            filled[target.param] += tensor.numel()
    if unexpected:
        raise UnsupportedModelError(f"{checkpoint_dir}: unexpected tensors {unexpected[:5]} (+{max(0, len(unexpected) - 5)} more)")
    expected = {name: _expected_numel(model, name, param) for name, param in params.items()}
    if model.config.tie_word_embeddings and "lm_head.weight" in params:
        filled["lm_head.weight"] = expected["lm_head.weight"]
    missing = [n for n, count in filled.items() if count != expected[n]]
    if missing:
        raise CheckpointError(f"{checkpoint_dir}: tensors missing or incomplete for {missing[:5]} (+{max(0, len(missing) - 5)} more)")


def _slices(model: DecoderModel, target: _Target, param: torch.Tensor, shape) -> list[tuple[torch.Tensor, tuple]]:
    module_name, _, attr = target.param.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "weight_slices"):
        return module.weight_slices(attr, target.part, shape)
    held = getattr(module, "experts_held", None)  # an expert-parallel rank's experts
    index: tuple = (slice(None),)
    dest = param.data
    if target.expert is not None:
        if target.expert not in held:
            return []
        dest = dest[target.expert - held.start]
    elif held is not None and attr in ("w13", "w2"):  # all experts stacked in one tensor
        index = (slice(held.start, held.stop),)
    if target.num_rows is not None:
        dest = dest[target.row_start : target.row_start + target.num_rows]
    return [(dest, index)]


def _expected_numel(model: DecoderModel, name: str, param: torch.Tensor) -> int:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    return module.loaded_numel(attr) if hasattr(module, "loaded_numel") else param.numel()


def checkpoint_target(name: str, model: DecoderModel) -> _Target:
    """Where checkpoint tensor ``name`` lands in ``model`` (its parameter and fused part)."""
    target = _target(name, model)
    if target is None:
        raise UnsupportedModelError(f"tensor {name!r} has no place in the model")
    return target


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _target(name: str, model: DecoderModel) -> _Target | None:
    m = _LAYER.match(name)
    if m is None:
        if name == "model.embed_tokens.weight" and model.embed_tokens is None:  # a later stage's tied LM head
            return _Target("lm_head.weight")
        return _Target(name.removeprefix("model."))
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    config = model.config
    attn = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
    if attn:
        return _Target(f"{prefix}self_attn.qkv_proj.{attn.group(2)}", part=attn.group(1))
    expert = _EXPERT.match(rest)
    if expert and config.moe is not None:
        e, proj = int(expert.group(1)), expert.group(2)
        size = config.moe.expert_intermediate_size
        slot = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", size), "up_proj": ("w13", size)}.get(proj)
        if slot is not None:
            return _Target(f"{prefix}mlp.{slot[0]}", expert=e, row_start=slot[1], num_rows=size)
        return _Target(f"{prefix}mlp.w2", expert=e) if proj in ("w2", "down_proj") else None
    fused = {"mlp.experts.gate_up_proj": "mlp.w13", "mlp.experts.down_proj": "mlp.w2"}.get(rest)
    if fused:
        return _Target(prefix + fused)
    rest = rest.replace("block_sparse_moe.gate.", "mlp.gate.")
    dense = re.match(r"^(mlp(?:\.shared_expert)?)\.(gate|up)_proj\.weight$", rest)
    if dense:
        return _Target(f"{prefix}{dense.group(1)}.gate_up_proj.weight", part=dense.group(2))
    return _Target(prefix + rest)
