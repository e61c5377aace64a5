"""The OpenAI-compatible API: /v1/models, /v1/completions and /v1/chat/completions.

Requests become GenerateRequests (openai_schema.py) and run through
``GenerationService.generate``. A streamed call answers its status only after the first
response is in, so a refusal (unknown model, full queue, prompt too long) is an HTTP status with
OpenAI's error body, never a 200 stream that carries an error; an error after that is sent as
one ``data: {"error": ...}`` event before ``[DONE]``, as vLLM does.

A router that dies cuts its HTTP streams (the connection drops without ``[DONE]``); a client
that asked for ``return_resume`` sends the request again with ``resume`` (openai_schema.py) to
any router, and the answer goes on where it stopped. Any other client sees a dropped connection
(or a proxy's 502/503) and must ask again from the start.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from proto import splitserve_pb2 as pb
from router.errors import CallRejected
from router.frontend.apis.errors import APIError, from_rejected, openai_body
from router.frontend.apis.openai_schema import OpenAIRequest, parse_chat, parse_completion
from router.frontend.apis.streaming import SSE_DONE, EventStreamResponse, answered_unless_disconnected, sse_event
from router.frontend.service import GenerationService

TENANT_SALT_HEADER = "x-splitserve-tenant-salt"
"""The HTTP form of GenerateRequest.tenant_salt: tenants with different salts never share cached blocks."""

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def openai_router(service: GenerationService) -> APIRouter:
    """The /v1 routes over ``service``."""
    routes = APIRouter()

    @routes.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(m) for m in service.directory.model_infos()]}

    @routes.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        for info in service.directory.model_infos():
            if info.id == model:
                return _model_card(info)
        raise APIError(404, f"model: {model[:64]!r} is not served here", param="model", code="model_not_found")

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = parse_completion(await read_json(request), _served(service))
        return await _respond(service, request, parsed, _CompletionShape(parsed.model))

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = parse_chat(await read_json(request), _served(service))
        return await _respond(service, request, parsed, _ChatShape(parsed.model))

    return routes


async def read_json(request: Request) -> object:
    """The request body as JSON; a 400 naming the problem when it is not."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body: not valid JSON ({e})") from e


def _served(service: GenerationService) -> dict[str, pb.ModelInfo]:
    return {m.id: m for m in service.directory.model_infos()}


def _model_card(info: pb.ModelInfo) -> dict:
    return {"id": info.id, "object": "model", "created": 0, "owned_by": "splitserve", "max_model_len": info.max_model_len}


def usage_body(usage: pb.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


class _CompletionShape:
    """How /v1/completions shapes its answers."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str) -> None:
        self.model = model

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None) -> dict:
        return self.choice(text, finish_reason)

    def opening(self) -> dict | None:
        return None


class _ChatShape:
    """How /v1/chat/completions shapes its answers."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str) -> None:
        self.model = model

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


async def _respond(service: GenerationService, request: Request, parsed: OpenAIRequest, shape) -> Response:
    parsed.generate.request_id = uuid.uuid4().hex
    parsed.generate.tenant_salt = request.headers.get(TENANT_SALT_HEADER, "")
    envelope = {"id": shape.id_prefix + parsed.generate.request_id, "created": int(time.time()), "model": shape.model}
    responses = service.generate(parsed.generate)
    if parsed.stream:
        return await _stream(request, responses, envelope, shape, parsed.include_usage, parsed.return_resume)
    return await _complete(request, responses, envelope, shape)


async def _complete(request: Request, responses: AsyncIterator[pb.GenerateResponse], envelope: dict, shape) -> Response:
    async def collect() -> tuple[str, pb.GenerateResponse]:
        texts, last = [], None
        async with contextlib.aclosing(responses):
            async for response in responses:
                texts.append(response.text)
                last = response
        return "".join(texts), last

    collected = await answered_unless_disconnected(request.receive, collect())
    if collected is None:
        return Response(status_code=499)  # nobody is listening; the request was cancelled
    text, last = collected
    body = {**envelope, "object": shape.object_name, "choices": [shape.choice(text, _FINISH_REASONS.get(last.finish_reason))], "usage": usage_body(last.usage)}
    return JSONResponse(body)


def resume_body(response: pb.GenerateResponse) -> dict:
    """What a chunk carries for a resume: its new token ids, the tag of every id so far, the seed."""
    body = {"token_ids": list(response.token_ids), "tag": base64.b64encode(response.resume_tag).decode()}
    if response.HasField("seed"):
        body["seed"] = response.seed
    return body


async def _stream(request: Request, responses: AsyncIterator[pb.GenerateResponse], envelope: dict, shape, include_usage: bool, return_resume: bool = False) -> Response:
    first = await answered_unless_disconnected(request.receive, anext(responses))
    if first is None:
        return Response(status_code=499)
    chunk = {**envelope, "object": shape.chunk_object_name}
    if include_usage:
        chunk["usage"] = None

    async def events() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(responses):
            if shape.opening() is not None:
                yield sse_event({**chunk, "choices": [shape.opening()]})
            response = first
            try:
                while True:
                    framed = from_response(response)
                    if framed:
                        yield framed
                    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        break
                    response = await anext(responses)
            except CallRejected as rejected:
                yield sse_event(openai_body(from_rejected(rejected)))
            yield SSE_DONE

    def from_response(response: pb.GenerateResponse) -> bytes:
        finish_reason = _FINISH_REASONS.get(response.finish_reason)
        out = b""
        if return_resume and response.token_ids:  # every id, even one whose text is still incomplete
            out += sse_event({**chunk, "choices": [shape.delta(response.text, None)], "resume": resume_body(response)})
        elif response.text:
            out += sse_event({**chunk, "choices": [shape.delta(response.text, None)]})
        if finish_reason is not None:
            out += sse_event({**chunk, "choices": [shape.delta("", finish_reason)]})
            if include_usage:
                out += sse_event({**chunk, "choices": [], "usage": usage_body(response.usage)})
        return out

    return EventStreamResponse(events())
