"""Prompts to token ids in the router, so requests reach the workers as ids and no worker tokenizes.

A router starts before any worker and loads no checkpoint. The first time it meets a model it
fetches the model's tokenizer files from a decode worker that serves it, writes them to a
directory of its own and builds from them the same ``engine.tokenizer.Tokenizer`` the workers
build from the checkpoint::

    first request for model M:  decode worker --tokenizer_files()--> {tokenizer.json, ...}
                                -> <cache dir>/<hash of M>/ -> Tokenizer.from_dir     in the pool
    every request:              apply_chat_template (messages), encode                in the pool

Both steps run in a pool of ``RouterConfig.tokenizer_threads`` threads. The tokenizers library
lets go of the GIL while it encodes, so a 32k-token prompt does not hold up the event loop,
where every other call is routed and streamed. A load that failed is tried again on the next
request (the worker may have died, or its files been fixed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from engine.errors import CheckpointError, InvalidRequestError
from engine.tokenizer import TOKENIZER_FILES, Tokenizer
from proto import splitserve_pb2 as pb
from router.errors import CallRejected
from router.errors import quoted
from router.routing.worker_calls import tokenizer_files
from router.routing.workers import Replica


class RouterTokenizers:
    """Each model's tokenizer in this router, loaded on first use, and the threads that run it."""

    def __init__(self, num_threads: int, fetch_files: Callable[[Replica], Awaitable[dict[str, bytes]]] | None = None) -> None:
        """``fetch_files``: a replica's tokenizer files by name (default: ask the decode worker)."""
        if num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
        self._fetch_files = fetch_files or _files_from_worker
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}
        self._cache_dir: Path | None = None
        """Made on the first load; removed by ``close``."""

    async def encode(self, replica: Replica, prompt: str | None, messages: Sequence[pb.ChatMessage] = (), add_special_tokens: bool = True, tools_json: str = "") -> pb.TokenizeResponse:
        """``prompt``, or the chat ``messages`` as the model's template renders them (with
        ``tools_json``, ``GenerateRequest.tools_json``, as its ``tools``), as the token ids of
        the model ``replica`` (a decode worker) serves. Raises CallRejected:
        INVALID_ARGUMENT naming ``messages`` when the model has no chat template or the
        template refuses them, FAILED_PRECONDITION when the model's tokenizer cannot be
        loaded; WorkerDied when the replica dies while its files are fetched."""
        model = replica.model.id
        tokenizer = await self.tokenizer(replica)
        try:
            chat = [chat_message(m) for m in messages]
            tools = _tools(tools_json)
            return await asyncio.get_running_loop().run_in_executor(self._pool, _encode, tokenizer, model, prompt, chat, add_special_tokens, tools)
        except InvalidRequestError as e:
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e

    async def tokenizer(self, replica: Replica) -> Tokenizer:
        """The tokenizer of the model ``replica`` serves; the first call fetches its files."""
        model = replica.model.id
        loading = self._loading.get(model)
        if loading is None or (loading.done() and (loading.cancelled() or loading.exception() is not None)):
            loading = self._loading[model] = asyncio.ensure_future(self._load(model, replica))
        return await asyncio.shield(loading)  # one caller leaving does not cancel the others' load

    def close(self) -> None:
        """Stop the threads (work not started is dropped) and remove the fetched files."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._cache_dir is not None:
            shutil.rmtree(self._cache_dir, ignore_errors=True)

    async def _load(self, model: str, replica: Replica) -> Tokenizer:
        files = await self._fetch_files(replica)
        if self._cache_dir is None:
            self._cache_dir = Path(tempfile.mkdtemp(prefix="splitserve-tokenizers-"))
        directory = self._cache_dir / hashlib.sha256(model.encode()).hexdigest()[:16]
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _write_and_load, directory, files)
        except CheckpointError as e:
            raise CallRejected(grpc.StatusCode.FAILED_PRECONDITION, f"model {quoted(model)}: its tokenizer cannot be loaded ({e})") from e


async def _files_from_worker(replica: Replica) -> dict[str, bytes]:
    return await tokenizer_files(replica.handle)


def _write_and_load(directory: Path, files: dict[str, bytes]) -> Tokenizer:
    """Only the names ``Tokenizer.from_dir`` reads are written: the worker names the files, not the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        path = directory / name
        if name in files:
            path.write_bytes(files[name])
        else:
            path.unlink(missing_ok=True)
    return Tokenizer.from_dir(directory)


def chat_message(message: pb.ChatMessage) -> dict:
    """A ChatMessage as transformers hands it to a chat template: tool calls as
    ``[{"id", "type": "function", "function": {"name", "arguments": dict}}]``, a tool turn's
    ``tool_call_id`` and ``name``; keys a message does not use are left out."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments_json)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _arguments(arguments_json: str) -> object:
    try:
        return json.loads(arguments_json) if arguments_json else {}
    except json.JSONDecodeError as e:
        raise InvalidRequestError("messages", f"tool call arguments are not valid JSON ({e})") from e


def _tools(tools_json: str) -> list[dict] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as e:
        raise InvalidRequestError("tools_json", f"not valid JSON ({e})") from e
    if not isinstance(tools, list):
        raise InvalidRequestError("tools_json", f"must be a JSON array of tool definitions, got {type(tools).__name__}")
    return tools


def _encode(tokenizer: Tokenizer, model: str, prompt: str | None, chat: list[dict], add_special_tokens: bool, tools: list[dict] | None = None) -> pb.TokenizeResponse:
    """Token ids as the decode worker's engine makes them (``Tokenizer.chat_prompt_ids`` for a chat)."""
    if chat:
        return pb.TokenizeResponse(token_ids=tokenizer.chat_prompt_ids(chat, model, tools))
    return pb.TokenizeResponse(token_ids=tokenizer.encode(prompt or "", add_special_tokens=add_special_tokens))
