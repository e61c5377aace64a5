"""The gRPC services of a router replica: Generation and Admin.

Every refusal is a CallRejected turned into a status in one place (``_abort``). A Generate call
streams its request's events off this router's channel to the decode worker; when the client
cancels, disconnects or runs out of deadline, grpc cancels this coroutine, which cancels the
request on the worker, aborting it and freeing its blocks. When the decode worker dies mid-call,
the call migrates to another one with the tokens already streamed, and the client sees one
uninterrupted stream::

    client ◄── t0 t1 t2 ─── router ◄── t0 t1 t2 ─── decode-0 ✗ (channel drops: WorkerDied)
                                   ── Submit(request, resume_token_ids=[t0 t1 t2]) ──► decode-1
    client ◄── t3 t4 ...─── router ◄── t3 t4 ... ── decode-1 (prefills prompt + t0..t2, samples t3)

A router that dies takes its streams' channel with it; the client resumes them through another
router the same way, sending the tokens it received (``GenerateRequest.resume``) with the tag
the last response carried (router.frontend.validation: the new router recomputes it, so a resume it cannot
verify is refused, never restarted). So that a sampled answer resumes token-identical, the router
seeds every sampled request that has no seed and reports the seed in the first response.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kv_store.keys import KeyNamespace
from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from proto import worker_pb2 as wpb
from router.config import RouterConfig
from router.errors import CallRejected, from_worker, invalid
from router.frontend.metrics import RouterMetrics
from router.frontend.samples import AnswerStream, generate_samples
from router.frontend.validation import ResumeTagger, check_generate, check_model, check_prompt_size, check_resume, is_greedy, resume_key
from router.routing.block_hashing import BlockHasher
from router.routing.policy import RouteRequest, RoutingPolicy
from router.routing.tokenization import RouterTokenizers
from router.routing.worker_calls import RequestIdInUse, WorkerChannels, WorkerDied
from router.routing.workers import Replica, WorkerDirectory, worker_load


logger = logging.getLogger(__name__)

_MIGRATION_POLL_S = 0.05
"""How often a migrating call looks for a live decode replica in the router's view."""


ROUTER_ERROR_METADATA = (("splitserve-error-origin", "router"),)
"""Trailing metadata of every status a router answers itself: a client tells a router's own
UNAVAILABLE (no live worker: another router would say the same) from a router that went away."""


async def _abort(context: grpc.aio.ServicerContext, rejected: CallRejected) -> None:
    await context.abort(rejected.code, rejected.message, trailing_metadata=ROUTER_ERROR_METADATA)


class GenerationService(pb_grpc.GenerationServicer):
    """Generate, Tokenize and ListModels over the worker pools."""

    def __init__(self, config: RouterConfig, directory: WorkerDirectory, metrics: RouterMetrics, policy: RoutingPolicy, channels: WorkerChannels) -> None:
        self.config = config
        self.directory = directory
        self.metrics = metrics
        self.policy = policy
        self.channels = channels
        self.num_inflight = 0
        self._hashers: dict[int, BlockHasher] = {}
        """Per block size: the prompts' block keys, hashed once across a session's turns."""
        self.tokenizers = RouterTokenizers(config.tokenizer_threads)
        """Prompt text and chat messages become token ids here: the workers get ids only."""
        self.resume_key = resume_key(config)
        """Keys the resume tags (router.frontend.validation): the same on every router of the cluster."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async with contextlib.aclosing(self.generate(request)) as responses:
                async for response in responses:
                    yield response
        except CallRejected as rejected:
            await _abort(context, rejected)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One generation, for every front end of this router (gRPC Generate, the OpenAI and
        KServe APIs): admission, routing, tenant salt, migration and metrics in one place.
        Raises CallRejected for a refused or failed call. Closing the iterator early (the client
        left) cancels the request on its worker, which frees its blocks: callers hold it in
        ``contextlib.aclosing`` so that happens at once, not when it is garbage-collected."""
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
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            self.num_inflight -= 1
            self.metrics.inflight.dec()
            self.metrics.finished(status)

    async def _generate(self, request: pb.GenerateRequest, start: float) -> AsyncIterator[pb.GenerateResponse]:
        """The call's responses: one answer, or the n samples a request asks for, interleaved."""
        check_generate(request, self.config, self.directory.served_models())
        num_samples = request.sampling.n if request.sampling.HasField("n") else 1
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.ClearField("resume")
        forwarded.sampling.ClearField("n")
        if not is_greedy(request.sampling) and not forwarded.sampling.HasField("seed") and not request.resume.token_ids:
            forwarded.sampling.seed = int.from_bytes(os.urandom(8), "little") >> 1
        forwarded.request_id = request.request_id or uuid.uuid4().hex
        if num_samples == 1:
            async for response in self._generate_one(forwarded, request.resume, AnswerStream(start)):
                yield response
            return
        async with contextlib.aclosing(generate_samples(self._generate_one, forwarded, num_samples, start)) as responses:
            async for response in responses:
                yield response

    async def _generate_one(self, forwarded: pb.GenerateRequest, resume: pb.Resume, stream: AnswerStream, pinned: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One answer's responses. When the decode replica serving it dies, the call migrates: it
        is submitted to another live replica (waiting up to ``migration_wait_s`` for one, e.g. the
        dead one's replacement) with the token ids already streamed, and goes on from there, up
        to ``max_migrations`` times. ``pinned``: start on this decode replica, prefilled there,
        while it is live (a sample sharing the prompt blocks of sample 0)."""
        if not is_greedy(forwarded.sampling):
            stream.seed = forwarded.sampling.seed if forwarded.sampling.HasField("seed") else None
        stream.tagger = ResumeTagger(self.resume_key, forwarded)
        if resume.token_ids:
            check_resume(forwarded, resume, self._vocab_size(forwarded.model), stream.tagger)
            stream.token_ids = list(resume.token_ids)
            stream.client_request_id = forwarded.request_id
            forwarded.request_id += f".resume-{uuid.uuid4().hex[:8]}"  # its cut predecessor may still be running on a worker under the client's id
        dead: set[str] = set()
        while True:
            replica = self.directory.replicas.get(pinned) if pinned and not dead else None
            if replica is None or not replica.status.healthy or replica.status.draining:
                replica = await self._decode_replica(forwarded.model, dead, stream.died_s is not None)
                pinned = None
            try:
                async for response in self._stream_from(replica, forwarded, stream, local_prefill=pinned is not None):
                    yield response
                return
            except WorkerDied as e:
                dead.add(replica.replica_id)
                if stream.num_migrations >= self.config.max_migrations:
                    after = f" (after {stream.num_migrations} migrations)" if stream.num_migrations else ""
                    raise CallRejected(grpc.StatusCode.UNAVAILABLE, f"decode worker {replica.replica_id} died: {e}{after}") from e
                stream.num_migrations += 1
                stream.died_s = time.perf_counter()
                self.metrics.migrated(bool(stream.token_ids))
                logger.warning("request %s: decode worker %s died after %d tokens (%s); migrating", forwarded.request_id, replica.replica_id, len(stream.token_ids), e)

    def _vocab_size(self, model: str) -> int:
        """The largest vocabulary of the live decode replicas of ``model`` (0: none live)."""
        return max((r.model.vocab_size for r in self.directory.healthy("decode", model)), default=0)

    async def _decode_replica(self, model: str, dead: set[str], migrating: bool) -> Replica:
        """The least loaded live decode replica not in ``dead``; a migrating call waits for one."""
        deadline = time.monotonic() + (self.config.migration_wait_s if migrating else 0.0)
        while True:
            replica = self.directory.pick("decode", model, exclude=dead)
            if replica is not None:
                return replica
            if time.monotonic() >= deadline:
                waited = f" within {self.config.migration_wait_s} s" if migrating else ""
                raise CallRejected(grpc.StatusCode.UNAVAILABLE, f"no live decode worker{waited}")
            await asyncio.sleep(_MIGRATION_POLL_S)

    async def _stream_from(self, replica: Replica, forwarded: pb.GenerateRequest, stream: AnswerStream, local_prefill: bool = False) -> AsyncIterator[pb.GenerateResponse]:
        """Run the call on ``replica`` from where ``stream`` stands. A fresh call may have its
        prompt prefilled by a prefill replica; a migrated one (or ``local_prefill``) is
        prefilled on ``replica``."""
        prefill = None if stream.token_ids or local_prefill else await self._choose_prefill(forwarded, replica)
        if (stream.token_ids or local_prefill) and not forwarded.prompt_token_ids:  # its prompt is still text
            await self._tokenize_prompt(forwarded, replica)
        replica.num_inflight += 1
        if prefill is not None:
            prefill.num_inflight += 1
        try:
            channel = self.channels.get(replica.replica_id, replica.handle)
            # aclosing: however this call ends, the channel drops its request id at once (not at GC)
            async with contextlib.aclosing(channel.generate(forwarded, prefill.replica_id if prefill else "", stream.token_ids)) as events:
                async for event in events:
                    if event.HasField("error"):
                        if event.error.code == wpb.RequestError.REPLICA_FAILED:
                            raise WorkerDied(event.error.message)  # the call migrates, as when the process dies
                        raise from_worker(event.error)
                    now = time.perf_counter()
                    if prefill is not None:
                        prefill.num_inflight -= 1  # its part is over once the first event is out
                        prefill = None
                    if stream.died_s is not None:
                        self.metrics.migration.observe(now - stream.died_s)
                        stream.died_s = None
                    if stream.last_s is None:
                        if stream.on_first_response is not None:
                            stream.on_first_response(replica.replica_id)
                        stream.ttft_s = now - stream.start_s
                        if stream.seed is not None:
                            event.response.seed = stream.seed
                        if not stream.client_request_id:
                            self.metrics.ttft.observe(stream.ttft_s)
                    elif event.response.token_ids:
                        self.metrics.inter_token.observe((now - stream.last_s) / len(event.response.token_ids))
                    stream.last_s = now
                    stream.token_ids += event.response.token_ids
                    stream.tagger.add(event.response.token_ids)
                    event.response.resume_tag = stream.tagger.tag()
                    if stream.client_request_id:
                        event.response.request_id = stream.client_request_id
                    self.metrics.output_tokens.inc(len(event.response.token_ids))
                    if event.response.HasField("usage") and stream.counts_prompt:
                        self.metrics.prompt_tokens.inc(event.response.usage.prompt_tokens)
                        self.metrics.prompt_length.observe(event.response.usage.prompt_tokens)
                    if event.response.HasField("timings") and not stream.num_migrations and not stream.client_request_id:
                        self.metrics.path_first_token.observe(max(0.0, stream.ttft_s - event.response.timings.worker_first_token_s))
                    yield event.response
            self.metrics.e2e.observe(time.perf_counter() - stream.start_s)
            if len(stream.token_ids) >= 2 and not stream.client_request_id and stream.last_s is not None:
                self.metrics.request_inter_token.observe((stream.last_s - stream.start_s - stream.ttft_s) / (len(stream.token_ids) - 1))
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
        """The prefill replica for ``request`` (None: the decode replica prefills it). A text or
        chat prompt is tokenized here first (once: the workers get the token ids)."""
        sent_as_ids = bool(request.prompt_token_ids)
        if not sent_as_ids:
            await self._tokenize_prompt(request, decode)
        prefills = self.directory.healthy("prefill", request.model)
        if not self.cache_aware(len(prefills)):
            if sent_as_ids:  # a text prompt too long is the engine's to refuse, after its sampling checks, as before
                check_fits_context(len(request.prompt_token_ids), [*prefills, decode])
            return prefills[0] if prefills else None
        chosen = self.route(request, prefills, decode)
        asyncio.get_running_loop().call_soon(self.policy.index.settle)  # once the request is sent (the call's first wait)
        return chosen

    def route(self, request: pb.GenerateRequest, prefills: list[Replica], decode: Replica) -> Replica | None:
        """The routing decision proper, on the event loop: hash the prompt's blocks, refuse a
        prompt no worker's context holds, ask the policy. What the decision leaves the prefix
        index to learn (``PrefixIndex.settle``) is the caller's to run after sending it."""
        token_ids = request.prompt_token_ids
        check_fits_context(len(token_ids), [*prefills, decode])
        namespace = prefills[0].namespace or decode.namespace
        keys = []
        block_size = namespace.block_size if namespace is not None else 16
        if namespace is not None:
            hasher = self._hashers.get(block_size) or self._hashers.setdefault(block_size, BlockHasher(block_size))
            full = (len(token_ids) - 1) // block_size * block_size  # the last token is always computed
            keys = hasher.keys(token_ids, _root_key(namespace, request.tenant_salt), num_tokens=full)
        route = RouteRequest(request.request_id, keys, len(token_ids), block_size)
        decision = self.policy.choose(route, [worker_load(p) for p in prefills], [worker_load(decode)])
        self.metrics.routed(decision.prefill is not None, decision.cached.blocks * route.block_size)
        return self.directory.replicas.get(decision.prefill) if decision.prefill else None

    async def _tokenize_prompt(self, request: pb.GenerateRequest, decode: Replica) -> None:
        """Replace the prompt (text or chat) with its token ids, made by this router with the
        tokenizer of the model ``decode`` serves: the workers get ids and never tokenize. An
        empty text prompt goes on as it is, for the engine to refuse by its own rules."""
        if request.HasField("prompt") and not request.prompt:
            return
        response = await self.tokenizers.encode(decode, request.prompt if request.HasField("prompt") else None, request.messages, tools_json=request.tools_json)
        request.ClearField("prompt")
        request.ClearField("messages")
        _set_prompt_token_ids(request, response)

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
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            return await self.tokenizers.encode(replica, request.prompt if request.HasField("prompt") else None, request.messages, add_special_tokens)
        except WorkerDied as e:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, f"decode worker {replica.replica_id} died: {e}") from e

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=self.directory.model_infos())


class AdminService(pb_grpc.AdminServicer):
    """Cluster status for operators, as the controller sees it."""

    def __init__(self, cluster_status: Callable[[], Awaitable[pb.ClusterStatus]]) -> None:
        self._cluster_status = cluster_status

    async def GetClusterStatus(self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStatus:
        return await self._cluster_status()


_PROMPT_TOKEN_IDS_TAG = bytes([pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt_token_ids"].number << 3 | 2])
if [f.name for f in pb.TokenizeResponse.DESCRIPTOR.fields] != ["token_ids"]:
    raise RuntimeError("TokenizeResponse has fields beside token_ids: _set_prompt_token_ids would copy them as ids")


def _set_prompt_token_ids(request: pb.GenerateRequest, response: pb.TokenizeResponse) -> None:
    """``request.prompt_token_ids = response.token_ids`` without a Python int per id: extending a
    repeated field id by id costs ~5 ms at 32k tokens on the event loop, where every other call
    waits. Both fields are packed varints (uint32 ids below 2^31 encode as int32 ids do, and a
    vocabulary never reaches 2^31), so the response's payload is re-tagged and parsed in C."""
    data = response.SerializeToString()
    if data:
        request.MergeFromString(_PROMPT_TOKEN_IDS_TAG + data[1:])


@functools.lru_cache(maxsize=4096)
def _root_key(namespace: KeyNamespace, tenant_salt: str) -> int:
    """The namespace's root key for a tenant, remembered: hashing the namespace's fields costs
    more than a lookup on every routing step."""
    return namespace.root_key(tenant_salt or None)


def check_fits_context(num_prompt_tokens: int, replicas: list[Replica]) -> None:
    """Refuse, before routing, a prompt longer than the context of every worker it could go to."""
    longest = max((r.model.max_model_len for r in replicas), default=0)
    if longest and num_prompt_tokens >= longest:
        raise invalid("prompt", f"{num_prompt_tokens} tokens do not fit the context of {longest} tokens (the longest any worker serves)")


async def _unary(context, method, request):
    try:
        return await method(request)
    except CallRejected as rejected:
        await _abort(context, rejected)
