"""The decode worker's Tokenize, called as the router calls it (the actor's coroutine, here in-process)."""

import asyncio
import json
import shutil

from decode_worker.actor import DecodeWorker
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb


def test_messages_for_a_model_without_a_chat_template_are_invalid_argument(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    worker = DecodeWorker("decode-t", EngineConfig(model=str(model_dir), kv_dtype="fp32", num_kv_blocks=8), WorkerConfig(kv_transport="none"))
    try:
        request = pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="hi")])
        result = asyncio.run(worker.tokenize(request))
        assert result.error.code == wpb.RequestError.INVALID_ARGUMENT
        assert result.error.message == "messages: model 'no-template' has no chat template"
        assert list(asyncio.run(worker.tokenize(pb.TokenizeRequest(prompt="hi"))).response.token_ids) == worker.engine.tokenizer.encode("hi")
    finally:
        asyncio.run(worker.shutdown())
