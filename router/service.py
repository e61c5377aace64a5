"""The gRPC services of a router replica: Generation and Admin.

Every refusal is a CallRejected turned into a status in one place (``_abort``). A Generate call
streams its request's events off this router's channel to the decode worker; when the client
cancels, disconnects or runs out of deadline, grpc cancels this coroutine, which cancels the
request on the worker, aborting it and freeing its blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from kv_store.keys import block_keys
from router.config import RouterConfig
from router.errors import CallRejected, from_worker
from router.metrics import RouterMetrics
from router.routing import RouteRequest, RoutingPolicy
from router.validation import check_generate, check_model, check_prompt_size
from router.worker_calls import RequestIdInUse, WorkerChannels, WorkerDied, tokenize
from router.workers import Replica, WorkerDirectory, worker_load


async def _abort(context: grpc.aio.ServicerContext, rejected: CallRejected) -> None:
    await context.abort(rejected.code, rejected.message)


class GenerationService(pb_grpc.GenerationServicer):
    """Generate, Tokenize and ListModels over the worker pools."""

    def __init__(self, config: RouterConfig, directory: WorkerDirectory, metrics: RouterMetrics, policy: RoutingPolicy, channels: WorkerChannels) -> None:
        self.config = config
        self.directory = directory
        self.metrics = metrics
        self.policy = policy
        self.channels = channels
        self.num_inflight = 0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        start = time.perf_counter()
        status = "OK"
        self.num_inflight += 1
        self.metrics.inflight.inc()
        try:
            if self.num_inflight > self.config.max_inflight_requests:
                raise CallRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router has {self.config.max_inflight_requests} calls in flight")
            async for response in self._generate(request, start):
                yield response
        except CallRejected as rejected:
            status = rejected.code.name
            await _abort(context, rejected)
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            self.num_inflight -= 1
            self.metrics.inflight.dec()
            self.metrics.finished(status)

    async def _generate(self, request: pb.GenerateRequest, start: float) -> AsyncIterator[pb.GenerateResponse]:
        check_generate(request, self.config, self.directory.served_models())
        replica = self.directory.pick("decode", request.model)
        if replica is None:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, "no live decode worker")
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = request.request_id or uuid.uuid4().hex
        prefill = await self._choose_prefill(forwarded, replica)
        last = ttft = None
        replica.num_inflight += 1
        if prefill is not None:
            prefill.num_inflight += 1
        try:
            channel = self.channels.get(replica.replica_id, replica.handle)
            events = channel.generate(forwarded, prefill.replica_id if prefill else "")
            async for event in events:
                if event.HasField("error"):
                    raise from_worker(event.error)
                now = time.perf_counter()
                if last is None:
                    if prefill is not None:
                        prefill.num_inflight -= 1  # its part is over once the first token is out
                        prefill = None
                    ttft = now - start
                    self.metrics.ttft.observe(ttft)
                elif event.response.token_ids:
                    self.metrics.inter_token.observe((now - last) / len(event.response.token_ids))
                last = now
                if event.response.HasField("timings"):
                    self.metrics.path_first_token.observe(max(0.0, ttft - event.response.timings.worker_first_token_s))
                yield event.response
            self.metrics.e2e.observe(time.perf_counter() - start)
        except WorkerDied as e:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, f"decode worker {replica.replica_id} died: {e}") from e
        except RequestIdInUse as e:
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        finally:
            replica.num_inflight -= 1
            if prefill is not None:
                prefill.num_inflight -= 1

    def cache_aware(self, num_prefill: int) -> bool:
        """Whether routing needs the prompt's block keys (and so the KV events)."""
        return num_prefill >= 2 or (num_prefill >= 1 and self.config.local_prefill_max_tokens > 0)

    async def _choose_prefill(self, request: pb.GenerateRequest, decode: Replica) -> Replica | None:
        """The prefill replica for ``request`` (None: the decode replica prefills it). Cache-aware
        routing tokenizes the prompt here (once: the worker gets the token ids) to hash its blocks."""
        prefills = self.directory.healthy("prefill", request.model)
        if not self.cache_aware(len(prefills)):
            return prefills[0] if prefills else None
        namespace = prefills[0].namespace or decode.namespace
        token_ids = list(request.prompt_token_ids) or await self._tokenize_prompt(request, decode)
        keys = []
        if namespace is not None:
            block_size = namespace.block_size
            keys = block_keys(token_ids[: (len(token_ids) - 1) // block_size * block_size], block_size, namespace.root_key(request.tenant_salt or None))
        route = RouteRequest(request.request_id, keys, len(token_ids), namespace.block_size if namespace else 16)
        decision = self.policy.choose(route, [worker_load(p) for p in prefills], [worker_load(decode)])
        self.metrics.routed(decision.prefill is not None, decision.cached.blocks * route.block_size)
        return self.directory.replicas.get(decision.prefill) if decision.prefill else None

    async def _tokenize_prompt(self, request: pb.GenerateRequest, decode: Replica) -> list[int]:
        """The prompt's token ids from the decode worker's tokenizer; the request then carries them."""
        ask = pb.TokenizeRequest(model=request.model, messages=request.messages)
        if request.HasField("prompt"):
            ask.prompt = request.prompt
        ids = list((await _tokenize_on(decode, ask)).token_ids)
        request.ClearField("prompt")
        request.ClearField("messages")
        request.prompt_token_ids.extend(ids)
        return ids

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await _unary(context, self._tokenize, request)

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        check_model(request.model, self.directory.served_models())
        if request.HasField("prompt") == bool(request.messages):
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, "prompt: give exactly one of prompt and messages")
        check_prompt_size(request.prompt, request.messages, self.config)
        replica = self.directory.pick("decode", request.model)
        if replica is None:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, "no live decode worker")
        return await _tokenize_on(replica, request)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=self.directory.model_infos())


class AdminService(pb_grpc.AdminServicer):
    """Cluster status for operators, as the controller sees it."""

    def __init__(self, cluster_status: Callable[[], Awaitable[pb.ClusterStatus]]) -> None:
        self._cluster_status = cluster_status

    async def GetClusterStatus(self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        return await self._cluster_status()


async def _tokenize_on(replica: Replica, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    try:
        result = await tokenize(replica.handle, request)
    except WorkerDied as e:
        raise CallRejected(grpc.StatusCode.UNAVAILABLE, f"decode worker {replica.replica_id} died: {e}") from e
    if result.HasField("error"):
        raise from_worker(result.error)
    return result.response


async def _unary(context, method, request):
    try:
        return await method(request)
    except CallRejected as rejected:
        await _abort(context, rejected)
