"""The OpenAI-compatible API: /v1/models, /v1/completions and /v1/chat/completions.

Requests become GenerateRequests (openai_schema.py) and run through
``GenerationService.generate``. A streamed call answers its status only after the first
response is in, so a refusal (unknown model, full queue, prompt too long) is an HTTP status with
OpenAI's error body, never a 200 stream that carries an error; an error after that is sent as
one ``data: {"error": ...}`` event before ``[DONE]``, as vLLM does.

With ``n`` > 1 every sample is a choice with its ``index``: a whole answer lists them in order,
a stream interleaves their chunks (each finishes with its own ``finish_reason`` chunk), and the
usage counts the prompt once and the completion tokens of all of them. How choices, their
log-probabilities and tool calls are shaped: openai_choices.py.

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
from router.frontend.apis.openai_choices import ChatChoice, CompletionChoice
from router.frontend.apis.openai_sampling import DEFAULT_MAX_N
from router.frontend.apis.openai_schema import OpenAIRequest, parse_chat, parse_completion
from router.frontend.apis.openai_shapes import Sample, summed_usage, usage_body
from router.frontend.apis.streaming import SSE_DONE, EventStreamResponse, answered_unless_disconnected, sse_event
from router.frontend.apis.token_texts import TokenStrings, model_tokenizer
from router.frontend.apis.tool_parsers import parser_for_template
from router.frontend.service import GenerationService

TENANT_SALT_HEADER = "x-splitserve-tenant-salt"
"""The HTTP form of GenerateRequest.tenant_salt: tenants with different salts never share cached blocks."""

__all__ = ["openai_router", "read_json", "resume_body", "usage_body", "TENANT_SALT_HEADER"]


def openai_router(service: GenerationService) -> APIRouter:
    """The /v1 routes over ``service``."""
    routes = APIRouter()
    max_n = getattr(service.config, "max_n", DEFAULT_MAX_N)

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
        parsed = parse_completion(await read_json(request), _served(service), max_n)
        return await _respond(service, request, parsed, chat=False)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = parse_chat(await read_json(request), _served(service), max_n)
        return await _respond(service, request, parsed, chat=True)

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


async def _choices(service: GenerationService, parsed: OpenAIRequest, chat: bool) -> list:
    """One choice shaper per sample; the tokenizer is fetched only when token texts or the
    template's tool-call format are needed."""
    auto_tools = parsed.tools is not None and parsed.tools.choice == "auto"
    tokenizer = await model_tokenizer(service, parsed.model) if parsed.logprobs is not None or auto_tools else None
    strings = TokenStrings(tokenizer)
    logprobs = parsed.logprobs is not None
    if not chat:
        return [CompletionChoice(i, strings, logprobs) for i in range(parsed.num_choices)]
    parser = parser_for_template(tokenizer.chat_template) if auto_tools else None
    return [ChatChoice(i, strings, logprobs, parsed.tools, parser) for i in range(parsed.num_choices)]


async def _respond(service: GenerationService, request: Request, parsed: OpenAIRequest, chat: bool) -> Response:
    choices = await _choices(service, parsed, chat)
    parsed.generate.request_id = uuid.uuid4().hex
    parsed.generate.tenant_salt = request.headers.get(TENANT_SALT_HEADER, "")
    envelope = {"id": choices[0].id_prefix + parsed.generate.request_id, "created": int(time.time()), "model": parsed.model}
    responses = service.generate(parsed.generate)
    try:
        if parsed.stream:
            return await _stream(request, responses, envelope, choices, parsed.include_usage, parsed.return_resume)
        return await _complete(request, responses, envelope, choices)
    except APIError as e:
        raise _named_constraint(e, parsed.constraint_field) from e


def _named_constraint(error: APIError, field: str | None) -> APIError:
    """The engine names a bad schema, regex or grammar ``constraint.*``; the client wrote it as ``field``."""
    if field is None or not (error.param or "").startswith("constraint"):
        return error
    return APIError(error.status, f"{field}: {error.message}", param=field, code=error.code)


async def _complete(request: Request, responses: AsyncIterator[pb.GenerateResponse], envelope: dict, choices: list) -> Response:
    async def collect() -> list[Sample]:
        samples = [Sample(i) for i in range(len(choices))]
        async with contextlib.aclosing(responses):
            async for response in responses:
                samples[response.index].add(response)
        return samples

    samples = await answered_unless_disconnected(request.receive, collect())
    if samples is None:
        return Response(status_code=499)  # nobody is listening; the request was cancelled
    body = {**envelope, "object": choices[0].object_name, "choices": [c.whole(s) for c, s in zip(choices, samples)], "usage": summed_usage(samples)}
    return JSONResponse(body)


def resume_body(response: pb.GenerateResponse) -> dict:
    """What a chunk carries for a resume: its new token ids, the tag of every id so far, the seed."""
    body = {"token_ids": list(response.token_ids), "tag": base64.b64encode(response.resume_tag).decode()}
    if response.HasField("seed"):
        body["seed"] = response.seed
    return body


async def _stream(request: Request, responses: AsyncIterator[pb.GenerateResponse], envelope: dict, choices: list, include_usage: bool, return_resume: bool = False) -> Response:
    first = await answered_unless_disconnected(request.receive, anext(responses))
    if first is None:
        return Response(status_code=499)
    chunk = {**envelope, "object": choices[0].chunk_object_name}
    if include_usage:
        chunk["usage"] = None

    async def events() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(responses):
            for choice in choices:
                if choice.opening() is not None:
                    yield sse_event({**chunk, "choices": [choice.opening()]})
            usages: dict[int, pb.Usage] = {}
            response = first
            try:
                while True:
                    framed = from_response(response)
                    if framed:
                        yield framed
                    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        usages[response.index] = response.usage
                        if len(usages) == len(choices):
                            break
                    response = await anext(responses)
                if include_usage:
                    yield sse_event({**chunk, "choices": [], "usage": usage_body([usages[i] for i in sorted(usages)])})
            except StopAsyncIteration:
                pass
            except CallRejected as rejected:
                yield sse_event(openai_body(from_rejected(rejected)))
            yield SSE_DONE

    def from_response(response: pb.GenerateResponse) -> bytes:
        choice = choices[response.index]
        deltas = choice.feed(response)
        resume = return_resume and response.token_ids  # every id, even one whose text is still incomplete
        if resume and not deltas:
            deltas = [choice.empty()]
        out = b""
        for k, delta in enumerate(deltas):
            out += sse_event({**chunk, "choices": [delta], **({"resume": resume_body(response)} if resume and k == 0 else {})})
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            out += b"".join(sse_event({**chunk, "choices": [delta]}) for delta in choice.finish(response))
        return out

    return EventStreamResponse(events())
