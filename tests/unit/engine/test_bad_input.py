"""Bad input raises a typed error naming the field, and leaves the pool untouched."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.errors import CheckpointError, InvalidRequestError, UnknownModelError, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine

NUM_BLOCKS = 3


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_model_len=64, num_kv_blocks=NUM_BLOCKS)


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1, got 0"),
        ({"temperature": -0.5}, "temperature", "must be >= 0, got -0.5"),
        ({"top_p": 0.0}, "top_p", r"must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "top_p", r"must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, "top_k", "must be an integer >= 0"),
        ({"stop": [""]}, "stop", "stop strings must be non-empty strings"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "stop token ids must be integers >= 0"),
    ],
)
def test_bad_sampling_params(kwargs, field, message):
    with pytest.raises(InvalidRequestError, match=f"^{field}: {message}") as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field", "message"),
    [
        ("", {}, "prompt", "must not be empty"),
        ([], {}, "prompt_token_ids", "must not be empty"),
        (None, {}, "prompt", "give a prompt or messages"),
        ("hi", {"messages": [{"role": "user", "content": "hi"}]}, "prompt", "give either prompt or messages, not both"),
        (None, {"messages": []}, "messages", "must not be empty"),
        (list(range(3, 67)), {}, "prompt", "64 tokens do not fit the context of 64 tokens"),
        ([5, 512], {}, "prompt_token_ids", r"token id 512 is outside the vocabulary \[0, 512\)"),
        ([5, -1], {}, "prompt_token_ids", r"token id -1 is outside"),
        ([5] * 40, {"params": SamplingParams(max_tokens=9)}, "max_tokens", "prompt plus max_tokens needs 4 KV blocks but the pool holds 3"),
    ],
)
def test_bad_prompts(engine, prompt, kwargs, field, message):
    params = kwargs.pop("params", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match=f"^{field}: {message}"):
        engine.add_request("bad", prompt, params, **kwargs)
    stats = engine.stats()
    assert (stats.num_free_kv_blocks, stats.num_waiting, stats.num_running) == (NUM_BLOCKS, 0, 0)


def test_duplicate_request_id(engine):
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="^request_id: 'dup' is already in use"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.run_to_completion(["dup"])
    assert engine.stats().num_free_kv_blocks == NUM_BLOCKS


def test_unknown_model_lists_the_bundled_names(tmp_path):
    with pytest.raises(UnknownModelError, match="no-such-model.*smollm2-135m"):
        LLMEngine(EngineConfig(model="no-such-model", cache_dir=tmp_path))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "gpt2")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="architecture 'GPT2LMHeadModel' is not supported"):
        make_engine(d)


def test_one_activation_plane_on_dense_weights_is_refused_as_changing_nothing(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"^act_planes: 1 sets the quantized C kernel, but no layer of this model runs it \(its weights are dense\)"):
        make_engine(tiny_llama_dir, weights="fp32", act_planes=1)


def test_unsupported_rope_type_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "rope")
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope' is not supported"):
        make_engine(d)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        make_engine(d)


def test_wrong_tensor_shape_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "shape")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: shape \(10,\)"):
        make_engine(d)


def test_missing_weights_and_config(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight files"):
        make_engine(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        make_engine(d)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"kv_dtype": "int8"}, "kv_dtype"), ({"dtype": "float16"}, "dtype"), ({"block_size": 0}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
     ({"act_planes": 3}, "act_planes"), ({"act_planes": 1, "device": "cuda", "weights": "fp32"}, "act_planes")],
)
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kwargs)


def test_an_invalid_request_error_survives_pickling_whole():
    import pickle

    from engine.errors import InvalidRequestError

    error = pickle.loads(pickle.dumps(InvalidRequestError("max_tokens", "must be >= 1")))
    assert (type(error), error.field, str(error)) == (InvalidRequestError, "max_tokens", "max_tokens: must be >= 1")
