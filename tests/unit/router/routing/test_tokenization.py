"""The router's own tokenization against the engine's Tokenizer, on the real SmolLM2 tokenizer files."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from engine.tokenizer import TOKENIZER_FILES, Tokenizer
from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.errors import CallRejected
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService
from router.routing.policy import make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.tokenization import RouterTokenizers
from router.routing.workers import Replica, WorkerDirectory

PROMPTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "Ünïcödé — 日本語 🙂", "<|im_start|>user\nspecial tokens in text<|im_end|>", "x" * 3000]
CHAT = [
    [pb.ChatMessage(role="user", content="What is 2 + 2?")],
    [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="assistant", content="Hello!"), pb.ChatMessage(role="user", content="Bye 🙂")],
]


def _replica(model: str) -> Replica:
    return Replica(None, pb.ModelInfo(id=model), pb.ReplicaStatus(replica_id=f"decode-{model}", pool="decode"))


def _files_of(directory):
    """What DecodeWorker.tokenizer_files returns for a checkpoint in ``directory``."""
    fetched = []

    async def fetch(replica):
        fetched.append(replica.model.id)
        return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}

    return fetch, fetched


def test_router_ids_equal_the_engine_tokenizers_for_prompts_and_chats(smollm2_dir):
    engine = Tokenizer.from_dir(smollm2_dir)
    fetch, fetched = _files_of(smollm2_dir)
    tokenizers = RouterTokenizers(2, fetch)
    replica = _replica("smollm2-135m")

    async def run():
        for prompt in PROMPTS:
            for special in (True, False):
                response = await tokenizers.encode(replica, prompt, add_special_tokens=special)
                assert list(response.token_ids) == engine.encode(prompt, add_special_tokens=special)
        for messages in CHAT:
            text = engine.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True)
            response = await tokenizers.encode(replica, None, messages)
            assert list(response.token_ids) == engine.encode(text, add_special_tokens=False)

    try:
        asyncio.run(run())
    finally:
        tokenizers.close()
    assert fetched == ["smollm2-135m"]  # fetched once, then cached


def test_a_generate_request_leaves_the_router_as_token_ids_only(smollm2_dir):
    engine = Tokenizer.from_dir(smollm2_dir)
    service = GenerationService(RouterConfig(), WorkerDirectory(), RouterMetrics("r-tok"), make_policy("splitserve", PrefixIndex()), channels=None)
    service.tokenizers = RouterTokenizers(1, _files_of(smollm2_dir)[0])
    request = pb.GenerateRequest(model="smollm2-135m", messages=CHAT[1], tenant_salt="t")
    try:
        asyncio.run(service._tokenize_prompt(request, _replica("smollm2-135m")))
    finally:
        service.tokenizers.close()
    text = engine.apply_chat_template([{"role": m.role, "content": m.content} for m in CHAT[1]], add_generation_prompt=True)
    assert list(request.prompt_token_ids) == engine.encode(text, add_special_tokens=False)
    assert not request.HasField("prompt") and not request.messages and request.tenant_salt == "t"  # the engine has nothing to tokenize


def test_a_model_without_a_template_or_with_broken_files_is_refused_by_name(tiny_llama_dir, tmp_path):
    no_template = tmp_path / "no-template"
    no_template.mkdir()
    for name in TOKENIZER_FILES:
        if (tiny_llama_dir / name).is_file():
            (no_template / name).write_bytes((tiny_llama_dir / name).read_bytes())
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    broken = {"tokenizer.json": b"{not json"}
    calls = {"broken": 0}

    async def fetch(replica):
        if replica.model.id == "broken":
            calls["broken"] += 1
            return broken
        return await _files_of(no_template)[0](replica)

    tokenizers = RouterTokenizers(1, fetch)

    async def run():
        with pytest.raises(CallRejected) as refused:
            await tokenizers.encode(_replica("no-template"), None, [pb.ChatMessage(role="user", content="hi")])
        assert (refused.value.code, refused.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, "messages: model 'no-template' has no chat template")
        assert len((await tokenizers.encode(_replica("no-template"), "hi")).token_ids) > 0  # plain prompts still work
        for _ in range(2):  # a failed load is not kept: each request tries again
            with pytest.raises(CallRejected) as refused:
                await tokenizers.encode(_replica("broken"), "hi")
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.message.startswith("model 'broken': its tokenizer cannot be loaded (") and "tokenizer.json" in refused.value.message

    try:
        asyncio.run(run())
    finally:
        tokenizers.close()
    assert calls["broken"] == 2


def test_tokenizer_threads_is_validated():
    with pytest.raises(ValueError, match="tokenizer_threads"):
        RouterConfig(tokenizer_threads=0)
