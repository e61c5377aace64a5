"""Tokenizer and IncrementalDetokenizer: SmolLM2 against transformers, and a tiny sentencepiece-style BPE."""

import json
from pathlib import Path

import pytest
import regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.bundled import bundled_model
from engine.errors import CheckpointError, InvalidRequestError
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

INCOMPLETE = "\ufffd"

# Strings on which SmolLM2's pre-tokenizer and plain GPT-2 splitting agree (see the digits test).
TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "12345",
    "Multiple   spaces\n\n\nand newlines\t\ttabs   ",
    "  leading and trailing spaces  ",
    "Café crème brûlée, naïve façade, Ærøskøbing",
    "日本語のテキストと中文文本，한국어",
    "Emoji: 👋🏽🎉🚀 and 👨‍👩‍👧",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|im_end|>more<|endoftext|>",
    "def f(x):\n    return x ** 2  # square",
    "",
]
# llama.cpp's "smollm" pre-tokenizer: isolate every number character, then GPT-2's split regex.
GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def llama_cpp_smollm_pieces(text: str) -> list[str]:
    return [piece for chunk in regex.split(r"(\p{N})", text) if chunk for piece in GPT2_SPLIT.findall(chunk)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' tokenizer built straight from the GGUF's metadata."""
    from transformers import AutoTokenizer

    gguf_path = bundled_model("smollm2-135m").gguf_path()
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.mark.slow
def test_encode_matches_transformers_gguf_tokenizer(tokenizer: Tokenizer, reference_tokenizer) -> None:
    for text in TEXTS:
        token_ids = tokenizer.encode(text)
        assert token_ids == reference_tokenizer.encode(text), text
        assert tokenizer.decode(token_ids, skip_special_tokens=False) == text
    assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]


@pytest.mark.slow
def test_digits_after_whitespace_follow_the_smollm_pre_tokenizer(tokenizer: Tokenizer, reference_tokenizer) -> None:
    # SmolLM2 isolates digits before splitting words (HF tokenizer.json: Digits + ByteLevel;
    # llama.cpp: "smollm"), so "x  1" keeps its two spaces together as "ĠĠ" (256).
    # transformers' GGUF tokenizer splits with GPT-2's regex alone and gives "Ġ", "Ġ" (216, 216).
    assert tokenizer.encode("x  1") == [104, 256, 33]
    assert reference_tokenizer.encode("x  1") == [104, 216, 216, 33]
    for text in [*TEXTS[:8], "x  1", "Total:   42 items", "a\n\n7", "  12345", "\t\t9 lives"]:
        pieces = llama_cpp_smollm_pieces(text)
        expected = [i for piece in pieces for i in reference_tokenizer.encode(piece, add_special_tokens=False)]
        assert tokenizer.encode(text) == expected, text


@pytest.mark.slow
def test_chat_template_matches_transformers(tokenizer: Tokenizer, reference_tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of Italy?"},
        ],
    ]
    for messages in conversations:
        expected = reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
    assert tokenizer.apply_chat_template(conversations[1], add_generation_prompt=False) == (
        "<|im_start|>system\nYou answer in one word.<|im_end|>\n<|im_start|>user\nCapital of Italy?<|im_end|>\n"
    )


@pytest.mark.slow
def test_smollm2_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.vocab_size == 49152
    assert tokenizer.has_chat_template
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False) == [26843]
    assert tokenizer.decode([1, 26843, 2]) == "Hi"
    assert tokenizer.decode([1, 26843, 2], skip_special_tokens=False) == "<|im_start|>Hi<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "expected_deltas"),
    [
        ("Café 👋", ["C", "af", "é", " ", "", "👋"]),
        ("日本語", ["", "日", "本", "", "", "語"]),
        ("naïve 🎉!", ["na", "ïve", " ", "", "🎉", "!"]),
    ],
)
def test_incremental_detokenizer_holds_back_split_characters(
    tokenizer: Tokenizer, text: str, expected_deltas: list[str]
) -> None:
    output_ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]).endswith(INCOMPLETE) for i in output_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("<|im_start|>assistant\n"))
    assert [detokenizer.add_tokens([i]) for i in output_ids] == expected_deltas
    assert detokenizer.flush() == ""


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens_per_step", [1, 2, 3])
def test_incremental_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, num_tokens_per_step: int) -> None:
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}]))
    text = " Grüße aus Köln 🇩🇪! 東京タワーは333m。 Ça va? 🧑🏽‍🍳 naïve résumé<|im_end|>"
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    steps = range(0, len(output_ids), num_tokens_per_step)
    deltas = [detokenizer.add_tokens(output_ids[i : i + num_tokens_per_step]) for i in steps]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(output_ids) == text.removesuffix("<|im_end|>")
    assert [delta for delta in deltas if INCOMPLETE in delta] == []


@pytest.mark.slow
def test_flush_releases_a_character_cut_off_at_the_end(tokenizer: Tokenizer) -> None:
    output_ids = tokenizer.encode("ok 👋")[:-1]  # 3 of the emoji's 4 bytes
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detokenizer.add_tokens([i]) for i in output_ids) == "ok "
    assert detokenizer.flush() == INCOMPLETE
    assert detokenizer.flush() == ""
    assert tokenizer.decode(output_ids) == "ok " + INCOMPLETE


@pytest.fixture(scope="module")
def sentencepiece_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE checkpoint with a Metaspace (sentencepiece-style) pre-tokenizer and decoder."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    corpus = ["hello world", "hello again world", "the world says hello", "again and again"] * 10
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>", "<eot>"])
    backend.train_from_iterator(corpus, trainer)
    checkpoint_dir = tmp_path_factory.mktemp("sentencepiece_style")
    backend.save(str(checkpoint_dir / "tokenizer.json"))
    (checkpoint_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},
                "unk_token": "<unk>",
            }
        )
    )
    (checkpoint_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (checkpoint_dir / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    return checkpoint_dir


def test_bos_is_added_once_when_the_config_asks(sentencepiece_style_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_style_dir)
    plain_ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.encode("hello world") == [1, *plain_ids]
    assert tokenizer.decode([1, *plain_ids]) == "hello world"
    assert tokenizer.decode([1, *plain_ids], skip_special_tokens=False) == "<s> hello world"


def test_eos_ids_join_the_tokenizer_and_generation_config(sentencepiece_style_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_style_dir)
    assert tokenizer.eos_token_ids == frozenset({2, 3})
    vocab = json.loads((sentencepiece_style_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert tokenizer.vocab_size == len(vocab)


def test_chat_template_from_its_own_file_with_raise_exception(sentencepiece_style_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_style_dir)
    assert tokenizer.has_chat_template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert rendered == "<s>[user] hello</s>\n[assistant]"
    with pytest.raises(InvalidRequestError, match="bad role tool") as error:
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    assert error.value.field == "messages"
    with pytest.raises(InvalidRequestError, match="message 1 needs a string 'role' and 'content'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])


def test_incremental_detokenizer_keeps_the_space_a_decoder_drops_at_the_start(sentencepiece_style_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(sentencepiece_style_dir)
    prompt_ids = tokenizer.encode("hello")
    output_ids = tokenizer.encode("hello world again", add_special_tokens=True)[len(prompt_ids) :]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add_tokens([i]) for i in output_ids] + [detokenizer.flush()]
    # The stream continues the prompt, so it keeps the space that decoding the output alone drops.
    assert "".join(deltas) == " world again"
    assert tokenizer.decode(output_ids) == "world again"


def test_missing_or_broken_tokenizer_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json: not valid JSON"):
        Tokenizer.from_dir(tmp_path)


def test_model_without_chat_template_rejects_messages(sentencepiece_style_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((sentencepiece_style_dir / "tokenizer.json").read_text())
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert not tokenizer.has_chat_template
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == frozenset()
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>{% endfor %}"
    "{% elif m['role'] == 'tool' %}({{ m['tool_call_id'] }}) {{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_tools_and_tool_calls_reach_the_template_as_transformers_passes_them(sentencepiece_style_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((sentencepiece_style_dir / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.chat_template == TOOL_TEMPLATE
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "get"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert tokenizer.apply_chat_template(messages, tools=tools) == (
        '<tools>get;</tools>\n[user]weather?\n[assistant]<call>get {"city": "Oslo"}</call>\n[tool](call_1) rain\n[assistant]'
    )
    assert tokenizer.apply_chat_template(messages[:1]) == "[user]weather?\n[assistant]"  # no tools: none rendered
    assert tokenizer.chat_prompt_ids(messages[:1], "m", tools) == tokenizer.encode("<tools>get;</tools>\n[user]weather?\n[assistant]", add_special_tokens=False)


def test_token_bytes_are_the_pieces_raw_bytes(tokenizer: Tokenizer, sentencepiece_style_dir: Path) -> None:
    text = " héllo 日本"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in token_ids) == text.encode()
    assert any(tokenizer.token_text(i) == "\ufffd" for i in token_ids)  # 日 is split over three byte pieces
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert [tokenizer.token_text(i) for i in im_end] == ["<|im_end|>"]
    metaspace = Tokenizer.from_dir(sentencepiece_style_dir)
    [hello] = metaspace.encode("hello", add_special_tokens=False)
    assert (metaspace.token_text(hello), metaspace.token_bytes(hello)) == ("hello", b"hello")
