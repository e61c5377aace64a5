"""KServe v2 / Triton ``inference.GRPCInferenceService`` on the router's gRPC port.

Served from tritonclient's compiled protos, so ``tritonclient.grpc`` works unchanged. The model
is decoupled: ModelInfer answers a non-streaming request with one response, ModelStreamInfer
answers each request on the stream with one response per new piece of text (``stream`` true)
or one in all, the last flagged ``triton_final_response``. A request with the ``logprobs``
parameter gets a ``logprobs`` output in each response with text (tensors.py). Requests on one stream run
concurrently; a bad one gets an ``error_message`` response and the stream goes on. Ending the
call (client cancel or disconnect) cancels every request still running on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from proto import splitserve_pb2 as pb
from router.errors import CallRejected
from router.frontend.apis.errors import APIError, grpc_status, invalid
from router.frontend.apis.tensors import (
    INPUT_DATATYPES, LOGPROBS_OUTPUT, TEXT_OUTPUT, LLMRequest, Tensor, deserialize_bool, deserialize_bytes, llm_request,
    logprobs_json, model_metadata, named_constraint, serialize_bytes, unknown_model,
)
from router.frontend.apis.token_texts import TokenStrings, model_tokenizer
from router.frontend.service import GenerationService

logger = logging.getLogger(__name__)

SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
TENANT_SALT_METADATA = "x-splitserve-tenant-salt"
"""The call metadata carrying GenerateRequest.tenant_salt."""
SERVER_VERSION = "1"
_FINAL = "triton_final_response"
_EMPTY_FINAL = "triton_enable_empty_final_response"
_END = object()


def add_kserve_service(server: grpc.aio.Server, generation: GenerationService) -> None:
    kpb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeInferenceService(generation), server)


class KServeInferenceService(kpb_grpc.GRPCInferenceServiceServicer):
    """Health, metadata, config and inference of the served models; other Triton methods
    (repository control, shared memory, tracing) answer UNIMPLEMENTED."""

    def __init__(self, generation: GenerationService) -> None:
        self.generation = generation

    def _served(self) -> list[str]:
        return self.generation.directory.served_models()

    async def ServerLive(self, request: kpb.ServerLiveRequest, context) -> kpb.ServerLiveResponse:
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: kpb.ServerReadyRequest, context) -> kpb.ServerReadyResponse:
        return kpb.ServerReadyResponse(ready=bool(self._served()))

    async def ModelReady(self, request: kpb.ModelReadyRequest, context) -> kpb.ModelReadyResponse:
        return kpb.ModelReadyResponse(ready=request.name in self._served())

    async def ServerMetadata(self, request: kpb.ServerMetadataRequest, context) -> kpb.ServerMetadataResponse:
        return kpb.ServerMetadataResponse(name="splitserve", version=SERVER_VERSION, extensions=["generate"])

    async def ModelMetadata(self, request: kpb.ModelMetadataRequest, context) -> kpb.ModelMetadataResponse:
        await self._known(request.name, context)
        return json_format.ParseDict(model_metadata(request.name), kpb.ModelMetadataResponse())

    async def ModelConfig(self, request: kpb.ModelConfigRequest, context) -> kpb.ModelConfigResponse:
        await self._known(request.name, context)
        return kpb.ModelConfigResponse(config=model_config(request.name))

    async def ModelInfer(self, request: kpb.ModelInferRequest, context: grpc.aio.ServicerContext) -> kpb.ModelInferResponse:
        try:
            llm = self._parse(request, context)
            if llm.stream:
                raise invalid("stream", "a streamed (decoupled) request needs ModelStreamInfer")
            strings = await self._strings(llm)
            async with contextlib.aclosing(self.generation.generate(llm.generate)) as responses:
                collected = [r async for r in responses]
        except APIError as e:
            await context.abort(grpc_status(e), e.message)
        except CallRejected as rejected:
            await context.abort(rejected.code, named_constraint(rejected.message, llm.constraint_field))
        text = "".join(r.text for r in collected)
        logprobs = _logprobs(collected, strings)
        return infer_response(request, text if llm.exclude_input_in_output else llm.prompt + text, final=True, logprobs=logprobs)

    async def _strings(self, llm: LLMRequest) -> TokenStrings | None:
        return TokenStrings(await model_tokenizer(self.generation, llm.generate.model)) if llm.logprobs else None

    async def ModelStreamInfer(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[kpb.ModelStreamInferResponse]:
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def read_requests() -> None:
            try:
                async for request in request_iterator:
                    tasks.add(asyncio.create_task(self._serve_streamed(request, context, queue)))
                await asyncio.gather(*tasks)
            finally:
                queue.put_nowait(_END)

        reader = asyncio.create_task(read_requests())
        try:
            while (item := await queue.get()) is not _END:
                yield item
            await reader  # surfaces a failure of the request stream itself
        finally:
            for task in (reader, *tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _serve_streamed(self, request: kpb.ModelInferRequest, context, queue: asyncio.Queue) -> None:
        """Put the responses of one request on a stream into ``queue``; errors as error_message."""
        llm = None
        try:
            llm = self._parse(request, context)
            empty_final = request.parameters[_EMPTY_FINAL].bool_param if _EMPTY_FINAL in request.parameters else False
            strings = await self._strings(llm)
            async with contextlib.aclosing(self.generation.generate(llm.generate)) as responses:
                if llm.stream:
                    await _stream_pieces(request, responses, queue, empty_final, strings)
                else:
                    collected = [r async for r in responses]
                    text = "".join(r.text for r in collected)
                    final = infer_response(request, text if llm.exclude_input_in_output else llm.prompt + text, final=True, logprobs=_logprobs(collected, strings))
                    queue.put_nowait(_streamed(final))
        except APIError as e:
            queue.put_nowait(kpb.ModelStreamInferResponse(error_message=e.message))
        except CallRejected as rejected:
            message = named_constraint(rejected.message, llm.constraint_field if llm else None)
            queue.put_nowait(kpb.ModelStreamInferResponse(error_message=f"{rejected.code.name}: {message}"))

    def _parse(self, request: kpb.ModelInferRequest, context) -> LLMRequest:
        served = self._served()
        if not served:
            raise APIError(503, "no live decode worker")
        if request.model_name not in served:
            raise unknown_model(request.model_name, served)
        for output in request.outputs:
            if output.name not in (TEXT_OUTPUT, LOGPROBS_OUTPUT):
                raise invalid("outputs", f"unknown output {output.name!r} (the model has {TEXT_OUTPUT}, {LOGPROBS_OUTPUT})")
        parameters = {k: json_format.MessageToDict(v).popitem()[1] for k, v in request.parameters.items() if v.WhichOneof("parameter_choice")}
        llm = llm_request(request.model_name, grpc_inputs(request), parameters)
        llm.generate.request_id = uuid.uuid4().hex
        llm.generate.tenant_salt = dict(context.invocation_metadata() or ()).get(TENANT_SALT_METADATA, "")
        return llm

    async def _known(self, model: str, context) -> None:
        served = self._served()
        if model not in served:
            await context.abort(grpc.StatusCode.NOT_FOUND, unknown_model(model, served).message)


async def _stream_pieces(request: kpb.ModelInferRequest, responses: AsyncIterator[pb.GenerateResponse], queue: asyncio.Queue, empty_final: bool, strings: TokenStrings | None = None) -> None:
    """One response per piece of new text; the last one flagged final (or, when the client asked
    for it, an extra empty response flagged final, as Triton sends)."""
    async for response in responses:
        final = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        logprobs = _logprobs([response], strings)
        if (response.text or (logprobs is not None and response.logprobs)) and not (final and not empty_final):
            queue.put_nowait(_streamed(infer_response(request, response.text, final=False, logprobs=logprobs)))
        if final:
            if empty_final:
                queue.put_nowait(_streamed(infer_response(request, None, final=True)))
            else:
                queue.put_nowait(_streamed(infer_response(request, response.text, final=True, logprobs=logprobs)))


def _logprobs(responses: list[pb.GenerateResponse], strings: TokenStrings | None) -> str | None:
    return logprobs_json([e for r in responses for e in r.logprobs], strings) if strings is not None else None


def _streamed(response: kpb.ModelInferResponse) -> kpb.ModelStreamInferResponse:
    return kpb.ModelStreamInferResponse(infer_response=response)


def infer_response(request: kpb.ModelInferRequest, text: str | None, final: bool, logprobs: str | None = None) -> kpb.ModelInferResponse:
    """A response carrying ``text`` as ``text_output`` (None: no output, a bare final flag) and
    ``logprobs`` (its tokens' JSON) as the ``logprobs`` output."""
    response = kpb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version or "1", id=request.id)
    response.parameters[_FINAL].bool_param = final
    for name, value in ((TEXT_OUTPUT, text), (LOGPROBS_OUTPUT, None if text is None else logprobs)):
        if value is not None:
            response.outputs.add(name=name, datatype="BYTES", shape=[1])
            response.raw_output_contents.append(serialize_bytes([value.encode()]))
    return response


def grpc_inputs(request: kpb.ModelInferRequest) -> dict[str, Tensor]:
    """The request's inputs, from ``raw_input_contents`` (what tritonclient sends) or ``contents``."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid("raw_input_contents", f"{len(raw)} buffers for {len(request.inputs)} inputs")
    tensors = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in tensors:
            raise invalid(tensor.name, "given twice")
        if raw:
            values = _decode_raw(tensor.name, tensor.datatype, raw[i])
        elif tensor.datatype == "BYTES":
            values = list(tensor.contents.bytes_contents)
        elif tensor.datatype == "BOOL":
            values = list(tensor.contents.bool_contents)
        else:
            values = []
        tensors[tensor.name] = Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), values)
    return tensors


def _decode_raw(name: str, datatype: str, raw: bytes) -> list:
    if datatype == "BYTES":
        return deserialize_bytes(name, raw)
    if datatype == "BOOL":
        return deserialize_bool(name, raw)
    return []  # a datatype no input has: refused by name and datatype in llm_request


def model_config(model: str) -> mc.ModelConfig:
    """The Triton model config a client may inspect: decoupled, no batching, the LLM tensors."""
    types = {"BYTES": mc.TYPE_STRING, "BOOL": mc.TYPE_BOOL}
    config = mc.ModelConfig(name=model, backend="splitserve", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    for name, datatype in INPUT_DATATYPES.items():
        config.input.add(name=name, data_type=types[datatype], dims=[1], optional=name != "text_input")
    config.output.add(name=TEXT_OUTPUT, data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name=LOGPROBS_OUTPUT, data_type=mc.TYPE_STRING, dims=[-1])
    return config
