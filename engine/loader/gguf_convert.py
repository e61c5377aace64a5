"""Convert a llama.cpp GGUF file into a Hugging Face Llama checkpoint directory.

The engine loads one format, HF safetensors. A GGUF is therefore dequantized to float32 once and
written out as ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json`` and ``splitserve_source.json`` (the source
file's name, size and sha256). The directory appears atomically: it is written under a temporary
name next to ``out_dir`` and renamed into place, so readers never see half a checkpoint, and when
two processes convert at once the loser of the rename keeps the winner's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import CheckpointError, UnsupportedModelError

SOURCE_FILE_NAME = "splitserve_source.json"

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp pre-tokenizers that isolate every digit (`\p{N}`) before GPT-2's split regex; the
# HF tokenizer.json of these models spells the same thing as Digits(individual) + ByteLevel.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})
_GPT2_PRE_TOKENIZERS = frozenset({"gpt2", "default"})

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True)
class GGUFSource:
    """The file a checkpoint was converted from, as recorded in ``splitserve_source.json``."""

    file_name: str
    size_bytes: int
    sha256: str


def convert_gguf(gguf_path: Path, out_dir: Path, expected_sha256: str | None = None) -> Path:
    """Write the HF checkpoint of the Llama GGUF at ``gguf_path`` to ``out_dir`` and return it.

    ``expected_sha256``, when given, must match the file before anything is written. An
    ``out_dir`` that already holds a converted checkpoint is kept as it is.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = read_source(gguf_path)
    if expected_sha256 is not None and source.sha256 != expected_sha256:
        raise CheckpointError(f"{gguf_path}: sha256 {source.sha256} does not match the expected {expected_sha256}")
    reader = open_reader(gguf_path)
    config = _model_config(reader, gguf_path)
    tensors = _hf_tensors(reader, config, gguf_path)
    tokenizer = _build_tokenizer(reader, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "tokenizer_config.json", _tokenizer_config(reader, gguf_path, config))
        _write_json(tmp_dir / "generation_config.json", _generation_config(config))
        _write_json(tmp_dir / SOURCE_FILE_NAME, asdict(source))
        _make_readable_and_durable(tmp_dir)
        return _publish(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def read_source(gguf_path: Path) -> GGUFSource:
    """Name, size and sha256 of ``gguf_path``; ``CheckpointError`` when it cannot be read."""
    try:
        with open(gguf_path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
        size_bytes = os.stat(gguf_path).st_size
    except OSError as e:
        raise CheckpointError(f"{gguf_path}: cannot read the GGUF file ({e.strerror})") from e
    return GGUFSource(file_name=Path(gguf_path).name, size_bytes=size_bytes, sha256=digest.hexdigest())


def open_reader(gguf_path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, OSError) as e:
        raise CheckpointError(f"{gguf_path}: not a readable GGUF file, truncated or corrupt? ({e})") from e


_REQUIRED = object()


def _field(reader: gguf.GGUFReader, key: str, gguf_path: Path, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise CheckpointError(f"{gguf_path}: GGUF metadata has no {key!r}")
    return default


def _model_config(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture", gguf_path)
    if arch != "llama":
        raise UnsupportedModelError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "token_embd.weight" not in tensor_names:
        raise CheckpointError(f"{gguf_path}: no tensor 'token_embd.weight'")
    embedding = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    hidden_size = _field(reader, "llama.embedding_length", gguf_path)
    num_heads = _field(reader, "llama.attention.head_count", gguf_path)
    num_kv_heads = _field(reader, "llama.attention.head_count_kv", gguf_path, num_heads)
    if isinstance(num_kv_heads, list):
        raise UnsupportedModelError(f"{gguf_path}: per-layer KV head counts are not supported")
    head_dim = _field(reader, "llama.attention.key_length", gguf_path, hidden_size // num_heads)
    eps = _field(reader, "llama.attention.layer_norm_rms_epsilon", gguf_path)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(embedding.shape[1]),  # GGUF shape order: (hidden, vocab)
        "hidden_size": hidden_size,
        "intermediate_size": _field(reader, "llama.feed_forward_length", gguf_path),
        "num_hidden_layers": _field(reader, "llama.block_count", gguf_path),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _field(reader, "llama.context_length", gguf_path),
        # GGUF stores float32; str() of the float32 gives the short decimal the model card wrote.
        "rms_norm_eps": float(str(np.float32(eps))),
        "rope_theta": float(str(np.float32(_field(reader, "llama.rope.freq_base", gguf_path, 10000.0)))),
        "rope_scaling": _rope_scaling(reader, gguf_path),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", gguf_path, None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", gguf_path, None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", gguf_path, None),
        "torch_dtype": "float32",
    }


def _rope_scaling(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any] | None:
    scaling_type = _field(reader, "llama.rope.scaling.type", gguf_path, "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": _field(reader, "llama.rope.scaling.factor", gguf_path)}
    raise UnsupportedModelError(f"{gguf_path}: rope scaling {scaling_type!r} is not supported (supported: linear)")


def _hf_tensors(reader: gguf.GGUFReader, config: dict[str, Any], gguf_path: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name, gguf_path)
        # GGUF lists dimensions fastest-first (ne0 = columns); numpy and torch list rows first.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        try:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {tensor.name!r} has quantization {tensor.tensor_type.name}, "
                "which cannot be dequantized"
            ) from e
        except ValueError as e:
            raise CheckpointError(f"{gguf_path}: tensor {tensor.name!r} is truncated or corrupt ({e})") from e
        if hf_name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, config["num_key_value_heads"])
        tensors[hf_name] = np.ascontiguousarray(weights, dtype=np.float32)
    missing = sorted(_expected_tensor_names(config) - tensors.keys())
    if missing:
        raise CheckpointError(f"{gguf_path}: missing tensors for {', '.join(missing[:5])}")
    return tensors


def hf_tensor_name(gguf_name: str, gguf_path: Path) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[suffix]}"
    raise UnsupportedModelError(f"{gguf_path}: tensor {gguf_name!r} has no Llama equivalent")


def _expected_tensor_names(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{name}" for name in _LAYER_TENSOR_NAMES.values())
    return names


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Q or K projection.

    HF rotates halves (dims j and j + half form a pair); GGML rotates adjacent dims, so llama.cpp
    interleaves the two halves of every head:

        HF   rows of a head:  0 1 2 .. half-1 | half half+1 .. 2*half-1
        GGUF rows of a head:  0 half 1 half+1 2 half+2 .. half-1 2*half-1

    GGUF row 2*j + p holds HF row p*half + j: view the rows as (heads, half, 2), swap the last two.
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _build_tokenizer(reader: gguf.GGUFReader, gguf_path: Path) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's ``tokenizer.ggml.*`` metadata."""
    kind = _field(reader, "tokenizer.ggml.model", gguf_path)
    if kind != "gpt2":
        raise UnsupportedModelError(f"{gguf_path}: tokenizer model {kind!r} is not supported (supported: gpt2)")
    tokens = _field(reader, "tokenizer.ggml.tokens", gguf_path)
    token_types = _field(reader, "tokenizer.ggml.token_type", gguf_path, [])
    merges = [tuple(merge.split(" ")) for merge in _field(reader, "tokenizer.ggml.merges", gguf_path)]
    if any(len(merge) != 2 for merge in merges):
        raise CheckpointError(f"{gguf_path}: a BPE merge is not two tokens separated by one space")
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", gguf_path, "default"), gguf_path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    typed = list(zip(tokens, token_types))
    control = [token for token, token_type in typed if token_type == _TOKEN_TYPE_CONTROL]
    user_defined = [token for token, token_type in typed if token_type == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user_defined])
    return tokenizer


def _pre_tokenizer(name: str, gguf_path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGIT_SPLIT_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _GPT2_PRE_TOKENIZERS:
        return byte_level
    supported = ", ".join(sorted(_DIGIT_SPLIT_PRE_TOKENIZERS | _GPT2_PRE_TOKENIZERS))
    raise UnsupportedModelError(f"{gguf_path}: pre-tokenizer {name!r} is not supported (supported: {supported})")


def _tokenizer_config(reader: gguf.GGUFReader, gguf_path: Path, config: dict[str, Any]) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens", gguf_path)
    special_ids = {
        "bos_token": config["bos_token_id"],
        "eos_token": config["eos_token_id"],
        "unk_token": _field(reader, "tokenizer.ggml.unknown_token_id", gguf_path, None),
        "pad_token": config["pad_token_id"],
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _field(reader, "tokenizer.ggml.add_bos_token", gguf_path, False),
        "add_eos_token": _field(reader, "tokenizer.ggml.add_eos_token", gguf_path, False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    tokenizer_config.update({name: tokens[i] for name, i in special_ids.items() if i is not None})
    chat_template = _field(reader, "tokenizer.chat_template", gguf_path, None)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_config


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    names = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {name: config[name] for name in names if config[name] is not None}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _make_readable_and_durable(directory: Path) -> None:
    # mkdtemp creates the directory 0700; the cache is shared by every worker of the machine.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(tmp_dir: Path, out_dir: Path) -> Path:
    try:
        tmp_dir.rename(out_dir)
    except OSError as e:
        if (out_dir / SOURCE_FILE_NAME).is_file():
            return out_dir  # another process converted the same file first; its copy is complete
        raise CheckpointError(f"{out_dir}: exists and is not a converted checkpoint ({e.strerror})") from e
    return out_dir
