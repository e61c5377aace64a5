"""``--weights native`` loads each linear layer once: from the GGUF's blocks, never from the
checkpoint's float32 copy of it (``engine.quant.apply.load_native``). What the loader reads is
recorded at the checkpoint's slices, and the model it builds equals the one built by loading
everything and then replacing the projections (the old way). The GGUF's tensors are read
without parsing its metadata (``engine.loader.gguf_tensors``), as gguf's own reader reads them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import engine.build
import engine.loader.weights
from engine.errors import CheckpointError
from engine.loader.gguf_native import NativeTensor
from engine.loader.gguf_tensors import read_gguf_tensors
from engine.loader.weights import load_weights
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.quant.apply import apply_native, linear_layers, load_native
from engine.quant.blocks import unpack_blocks
from tests.unit.engine.helpers import make_engine
from tests.unit.engine.test_quant import gguf_blocks


def gguf_like(model_dir) -> dict[str, NativeTensor]:
    """The checkpoint as a GGUF like the bundled SmolLM2 holds it: projections in Q4_1, the
    embedding in Q8_0, norms and biases in F32."""
    native = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        kind = "Q8_0" if "embed" in name else "Q4_1" if tensor.ndim == 2 else "F32"
        blocks = None
        if kind != "F32":
            raw, _ = gguf_blocks(kind, tensor.float().numpy())
            blocks = unpack_blocks(kind, raw, *tensor.shape)
        native[name] = NativeTensor(kind, blocks)
    return native


@pytest.fixture
def read_names(monkeypatch) -> set[str]:
    """Names of the checkpoint tensors whose bytes the loader reads (a slice indexed)."""
    names: set[str] = set()
    real = engine.loader.weights.iter_checkpoint

    class RecordingSlice:
        def __init__(self, name, source):
            self.name, self.source = name, source

        def get_shape(self):
            return self.source.get_shape()

        def __getitem__(self, index):
            names.add(self.name)
            return self.source[index]

    def recording(checkpoint_dir):
        for name, source in real(checkpoint_dir):
            yield name, RecordingSlice(name, source)

    monkeypatch.setattr(engine.loader.weights, "iter_checkpoint", recording)
    return names


def dense_names(native: dict[str, NativeTensor]) -> set[str]:
    return {name for name, tensor in native.items() if tensor.blocks is None or "embed" in name}


@pytest.mark.parametrize("name", ["llama-tied", "qwen2"])
def test_native_load_reads_only_the_dense_tensors_and_builds_the_same_model(tiny_checkpoint, read_names, name):
    model_dir = tiny_checkpoint(name)  # llama-tied: the LM head runs the embedding's Q8_0; qwen2: q/k/v biases
    config = ModelConfig.from_dir(model_dir)
    native = gguf_like(model_dir)
    model = DecoderModel.empty(config, 64, torch.float32)
    load_native(model, model_dir, native)
    assert read_names == dense_names(native)
    assert any(".bias" in n for n in read_names) == (name == "qwen2")

    read_names.clear()
    reference = DecoderModel.empty(config, 64, torch.float32)
    load_weights(reference, model_dir)
    apply_native(reference, native)
    assert len(read_names) == len(native)
    expected = dict(linear_layers(reference))
    for layer_name, module in linear_layers(model):
        assert module.weight is None and module.quantized.kind == expected[layer_name].quantized.kind, layer_name
        assert torch.equal(module.quantized.dequantize(), expected[layer_name].quantized.dequantize()), layer_name
    reference_params = dict(reference.named_parameters())
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in reference_params.items()}
    for param_name, param in model.named_parameters():
        assert torch.equal(param, reference_params[param_name]), param_name


def test_an_engine_with_native_weights_never_reads_the_replaced_projections(tiny_checkpoint, read_names, monkeypatch, tmp_path):
    """The engine's start-up path (``build_shard``) goes through ``load_native`` for a checkpoint
    converted from a GGUF; the GGUF is stood in for by the tiny checkpoint's own blocks."""
    model_dir = tiny_checkpoint("llama-tied")
    native = gguf_like(model_dir)
    gguf_path = tmp_path / "tiny.gguf"
    monkeypatch.setattr(engine.build, "source_gguf", lambda checkpoint_dir: gguf_path)
    monkeypatch.setattr(engine.build, "read_native_tensors", lambda path, config: native if path == gguf_path else None)
    llm = make_engine(model_dir, weights="native")
    assert read_names == dense_names(native)
    kinds = {n: m.quantized.kind for n, m in linear_layers(llm.runner.model)}
    assert kinds.pop("lm_head") == "int8" and set(kinds.values()) == {"int4"}


def test_gguf_tensors_are_read_as_gguf_reads_them_without_the_metadata(tmp_path):
    """Tensor names, types, dims and bytes equal ``gguf.GGUFReader``'s, past metadata of every
    kind (string and number arrays, a nested array) and a custom data alignment."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<s>"] * 5)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint64("test.big", 1 << 40)
    writer.add_bool("test.flag", True)
    rng = np.random.default_rng(5)
    q8, _ = gguf_blocks("Q8_0", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((5, 32)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = gguf.GGUFReader(path).tensors
    got = read_gguf_tensors(path)
    assert [(t.name, t.kind, t.dims) for t in got] == [(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in expected]
    for mine, theirs in zip(got, expected):
        assert np.array_equal(mine.data, np.asarray(theirs.data).reshape(-1).view(np.uint8)), mine.name
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"t\.gguf: not a readable GGUF file, truncated or corrupt\? \(tensor 'token_embd\.weight' runs past the end of the file\)"):
        read_gguf_tensors(path)
