"""KServe v2 over HTTP (``/v2/...``) and Triton's generate extension, for ``tritonclient.http``
and plain HTTP clients.

Infer bodies are JSON, or JSON followed by binary tensors (Triton's binary data extension: the
``Inference-Header-Content-Length`` header gives the JSON's size, each input's
``parameters.binary_data_size`` its bytes). ``text_output`` (and ``logprobs``, when asked for:
tensors.py) come back binary when the request asks for it (``binary_data`` on the output, or
``binary_data_output``), else as JSON data; /generate and /generate_stream carry ``logprobs``
as a JSON array beside ``text_output``.
Errors are ``{"error": "message"}`` with the same statuses as the OpenAI API's.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format

from proto import splitserve_pb2 as pb
from router.errors import CallRejected
from router.frontend.apis.errors import APIError, from_rejected, invalid
from router.frontend.apis.kserve_grpc import SERVER_VERSION, TENANT_SALT_METADATA, model_config
from router.frontend.apis.streaming import EventStreamResponse, answered_unless_disconnected, sse_event
from router.frontend.apis.tensors import (
    INPUT_DATATYPES, LOGPROBS_OUTPUT, STREAM, TEXT_OUTPUT, LLMRequest, Tensor, deserialize_bool, deserialize_bytes, llm_request,
    logprobs_json, model_metadata, named_constraint, serialize_bytes, unknown_model,
)
from router.frontend.apis.token_texts import TokenStrings, model_tokenizer
from router.frontend.service import GenerationService

HEADER_LENGTH = "inference-header-content-length"


def kserve_router(service: GenerationService) -> APIRouter:
    """The /v2 routes over ``service`` (more specific paths first: model ids may hold '/')."""
    routes = APIRouter()

    def served() -> list[str]:
        return service.directory.served_models()

    def known(model: str) -> str:
        if model not in served():
            raise unknown_model(model, served())
        return model

    @routes.get("/v2")
    async def server_metadata() -> dict:
        return {"name": "splitserve", "version": SERVER_VERSION, "extensions": ["generate", "binary_tensor_data"]}

    @routes.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @routes.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if served() else 503)

    @routes.get("/v2/models/{model:path}/ready")
    async def model_ready(model: str) -> Response:
        return Response(status_code=200 if model in served() else 404)

    @routes.get("/v2/models/{model:path}/config")
    async def config(model: str) -> dict:
        return json_format.MessageToDict(model_config(known(model)), preserving_proto_field_name=True)

    @routes.post("/v2/models/{model:path}/infer")
    async def infer(model: str, request: Request) -> Response:
        header, tensors, binary_outputs = await _infer_body(request)
        llm = _llm(known(model), tensors, header.get("parameters") or {}, request)
        if llm.stream:
            raise invalid(STREAM, "a streamed (decoupled) request needs generate_stream or gRPC ModelStreamInfer")
        generated = await _generate_text(service, request, llm)
        if generated is None:
            return Response(status_code=499)
        text, logprobs = generated
        outputs = {TEXT_OUTPUT: text if llm.exclude_input_in_output else llm.prompt + text}
        if logprobs is not None:
            outputs[LOGPROBS_OUTPUT] = logprobs
        return _infer_response(model, header.get("id"), outputs, binary_outputs)

    @routes.post("/v2/models/{model:path}/generate")
    async def generate(model: str, request: Request) -> Response:
        llm = _llm(known(model), *_generate_body(await _json(request)), request)
        if llm.stream:
            raise invalid(STREAM, "a streamed request needs generate_stream")
        generated = await _generate_text(service, request, llm)
        if generated is None:
            return Response(status_code=499)
        text, logprobs = generated
        body = {"model_name": model, "model_version": "1", TEXT_OUTPUT: text if llm.exclude_input_in_output else llm.prompt + text}
        if logprobs is not None:
            body[LOGPROBS_OUTPUT] = json.loads(logprobs)
        return JSONResponse(body)

    @routes.post("/v2/models/{model:path}/generate_stream")
    async def generate_stream(model: str, request: Request) -> Response:
        tensors, parameters = _generate_body(await _json(request))
        tensors.setdefault(STREAM, Tensor(STREAM, "BOOL", (1,), [True]))
        llm = _llm(known(model), tensors, parameters, request)
        return await _stream(service, request, llm, model)

    @routes.get("/v2/models/{model:path}/versions/{version}")
    @routes.get("/v2/models/{model:path}")
    async def metadata(model: str) -> dict:
        return model_metadata(known(model))

    return routes


def _llm(model: str, tensors: dict[str, Tensor], parameters: dict, request: Request) -> LLMRequest:
    llm = llm_request(model, tensors, parameters)
    llm.generate.request_id = uuid.uuid4().hex
    llm.generate.tenant_salt = request.headers.get(TENANT_SALT_METADATA, "")
    return llm


async def token_strings(service: GenerationService, llm: LLMRequest) -> TokenStrings | None:
    """Token texts for the ``logprobs`` output, when the request asks for it."""
    return TokenStrings(await model_tokenizer(service, llm.generate.model)) if llm.logprobs else None


async def _generate_text(service: GenerationService, request: Request, llm: LLMRequest) -> tuple[str, str | None] | None:
    """The whole generated text and its ``logprobs`` output (None: not asked for); None when the
    client left first (the call is then cancelled)."""
    strings = await token_strings(service, llm)

    async def collect() -> tuple[str, str | None]:
        texts, entries = [], []
        async with contextlib.aclosing(service.generate(llm.generate)) as responses:
            async for response in responses:
                texts.append(response.text)
                entries.extend(response.logprobs)
        return "".join(texts), logprobs_json(entries, strings) if strings is not None else None

    try:
        return await answered_unless_disconnected(request.receive, collect())
    except APIError as e:
        raise _named(e, llm) from e


def _named(error: APIError, llm: LLMRequest) -> APIError:
    message = named_constraint(error.message, llm.constraint_field)
    return error if message == error.message else APIError(error.status, message, param=llm.constraint_field, code=error.code)


async def _stream(service: GenerationService, request: Request, llm: LLMRequest, model: str) -> Response:
    """Triton's generate_stream: one ``data:`` event per piece of text (just one when stream is
    false); a refusal before the first piece is an HTTP error, a later one an ``error`` event."""
    strings = await token_strings(service, llm)
    responses = service.generate(llm.generate)
    try:
        first = await answered_unless_disconnected(request.receive, anext(responses))
    except APIError as e:
        raise _named(e, llm) from e
    if first is None:
        return Response(status_code=499)

    def event(text: str, entries) -> bytes:
        body = {"model_name": model, "model_version": "1", TEXT_OUTPUT: text}
        if strings is not None:
            body[LOGPROBS_OUTPUT] = json.loads(logprobs_json(entries, strings))
        return sse_event(body)

    async def events() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(responses):
            try:
                if not llm.stream:
                    rest = [r async for r in responses]
                    text = first.text + "".join(r.text for r in rest)
                    entries = [e for r in (first, *rest) for e in r.logprobs]
                    yield event(text if llm.exclude_input_in_output else llm.prompt + text, entries)
                    return
                response = first
                while True:
                    if response.text or (strings is not None and response.logprobs):
                        yield event(response.text, response.logprobs)
                    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return
                    response = await anext(responses)
            except CallRejected as rejected:
                yield sse_event({"error": from_rejected(rejected).message})

    return EventStreamResponse(events())


async def _json(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body: not valid JSON ({e})") from e


def _generate_body(body: object) -> tuple[dict[str, Tensor], dict]:
    """Triton's generate body: inputs by name at the top level, ``parameters`` beside them."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body: must be a JSON object, got {type(body).__name__}")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid("parameters", f"must be an object, got {type(parameters).__name__}")
    tensors = {}
    for name, value in body.items():
        if name in ("parameters", "id"):
            continue
        if name not in INPUT_DATATYPES:
            raise invalid(name, f"unknown input (the model takes {', '.join(INPUT_DATATYPES)})")
        if name == "sampling_parameters" and isinstance(value, dict):
            value = json.dumps(value)
        expected = str if INPUT_DATATYPES[name] == "BYTES" else bool
        if not isinstance(value, expected):
            raise invalid(name, f"must be a {'string' if expected is str else 'boolean'}, got {value!r}")
        tensors[name] = Tensor(name, INPUT_DATATYPES[name], (1,), [value])
    return tensors, parameters


async def _infer_body(request: Request) -> tuple[dict, dict[str, Tensor], set[str]]:
    """The JSON header, the input tensors, and the outputs that should come back binary."""
    body = await request.body()
    header_length = request.headers.get(HEADER_LENGTH)
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise invalid("Inference-Header-Content-Length", f"{header_length!r} is not a length within the {len(body)}-byte body")
        header_bytes, binary = body[: int(header_length)], body[int(header_length) :]
    else:
        header_bytes, binary = body, b""
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body: not valid JSON ({e})") from e
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise invalid("inputs", "required: a list of input tensors")
    tensors, offset = {}, 0
    for i, entry in enumerate(header["inputs"]):
        tensor, size = _input_tensor(i, entry, binary[offset:])
        if tensor.name in tensors:
            raise invalid(tensor.name, "given twice")
        tensors[tensor.name] = tensor
        offset += size
    return header, tensors, _binary_outputs(header)


def _input_tensor(i: int, entry: object, binary: bytes) -> tuple[Tensor, int]:
    """One input of the JSON header and how many bytes of the binary part it took."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise invalid(f"inputs[{i}]", "must be an object with a name")
    name, datatype, shape = entry["name"], entry.get("datatype"), entry.get("shape")
    if not isinstance(datatype, str):
        raise invalid(name, "datatype is required")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise invalid(name, "shape must be a list of integers")
    size = (entry.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise invalid(name, f"binary_data_size {size!r} exceeds the {len(binary)} bytes left in the body")
        raw = binary[:size]
        values = deserialize_bytes(name, raw) if datatype == "BYTES" else deserialize_bool(name, raw) if datatype == "BOOL" else []
        return Tensor(name, datatype, tuple(shape), values), size
    if "data" not in entry:
        raise invalid(name, "data is required (or parameters.binary_data_size)")
    return Tensor(name, datatype, tuple(shape), _flatten(entry["data"])), 0


def _flatten(data: object) -> list:
    if isinstance(data, list):
        return [v for item in data for v in _flatten(item)]
    return [data]


def _binary_outputs(header: dict) -> set[str]:
    """Outputs asked for as binary: by name (``binary_data``), else all (``binary_data_output``)."""
    every = bool((header.get("parameters") or {}).get("binary_data_output", False))
    asked = {o.get("name"): bool((o.get("parameters") or {}).get("binary_data", every)) for o in header.get("outputs") or () if isinstance(o, dict)}
    return {name for name in (TEXT_OUTPUT, LOGPROBS_OUTPUT) if asked.get(name, every)}


def _infer_response(model: str, request_id: object, outputs: dict[str, str], binary: set[str]) -> Response:
    body: dict = {"model_name": model, "model_version": "1", "outputs": []}
    if isinstance(request_id, str) and request_id:
        body["id"] = request_id
    raw = b""
    for name, text in outputs.items():
        output: dict = {"name": name, "datatype": "BYTES", "shape": [1]}
        body["outputs"].append(output)
        if name in binary:
            data = serialize_bytes([text.encode()])
            output["parameters"] = {"binary_data_size": len(data)}
            raw += data
        else:
            output["data"] = [text]
    if not raw:
        return JSONResponse(body)
    header = json.dumps(body).encode()
    return Response(header + raw, media_type="application/octet-stream", headers={"Inference-Header-Content-Length": str(len(header))})
