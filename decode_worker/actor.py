"""DecodeWorker: the Ray actor of one decode replica.

Without a prefill worker it prefills its own requests (aggregated). Given one, it parks the
request with blocks for the part of the prompt its pool lacks, asks the prefill worker to write
exactly those blocks over NIXL, and joins the request to its running batch with the first token
the prefill worker sampled::

    router ──Submit(request, prefill id)───> DecodeWorker        (the request plane: request_plane.py)
                                             park: lease blocks for prompt blocks [cached, end)
                                             ──prefill(TransferRequest, tokens)──> PrefillWorker
                                             <──── NIXL WRITE into the leased blocks + notif ────
                                             <──── TransferResult(first token) ────────────────
                                             join the batch, release the lease, stream

A hand-off that fails, times out or loses its prefill worker falls back to the failure policy:
``recompute`` prefills here, ``fail`` ends the request with an error. Either way the blocks the
write targeted stay leased until the prefill side can no longer touch them.

The controller creates it from its import path (`decode_worker.actor:DecodeWorker`) with the
pool's custom resource, so the router never imports this module. The controller does, and this
module imports no torch (the engine loads in EngineReplica.__init__, in the replica's process).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError, TaskCancelledError

from decode_worker.config import WorkerConfig
from decode_worker.kv_receiver import KVReceiver
from decode_worker.request_plane import RequestPlaneServer, RequestPlaneStats
from decode_worker.requests import to_engine_request, to_response
from engine.config import EngineConfig
from engine.errors import AdmissionQueueFull, EngineLoopFailed, InvalidRequestError, RequestFailedError
from engine.outputs import RemotePrefill
from engine.metrics import CountersCollector, RequestTimingHistograms
from engine.params import SamplingParams
from engine.replica import EngineReplica
from engine.request import EngineRequest, RequestTrace, TokenLogprobs
from engine.tokenizer import TOKENIZER_FILES
from kv_transfer.protocol import KVEndpoint, TransferRequest, TransferResult
from kv_transfer.registry import open_endpoint
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb

if TYPE_CHECKING:  # annotations only: importing torch here would cost the controller, which imports this class
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_DEAD = (RayActorError, ActorUnavailableError)
_GAUGES = frozenset({"num_open_leases", "num_open_handles"})
_NOTIF_GRACE_S = 5.0
"""How long the write's notification may trail the prefill worker's answer."""


def _error(code: int, message: str) -> wpb.WorkerEvent:
    return wpb.WorkerEvent(error=wpb.RequestError(code=code, message=message))


class RemotePrefillFailed(Exception):
    """A remote prefill failed under the ``fail`` policy; ``code`` is a RequestError code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TransferStats:
    """Counters of this worker's KV hand-offs (the receiving side)."""

    num_remote_prefills: int = 0
    """Hand-offs asked of a prefill worker."""
    num_failed: int = 0
    """Hand-offs that failed, timed out or lost their prefill worker."""
    num_recomputed: int = 0
    """Failed hand-offs whose request was prefilled here instead."""
    num_blocks_received: int = 0
    num_bytes_received: int = 0
    num_local_prefills: int = 0
    """Requests sent with a prefill worker that were prefilled here (prompt mostly cached)."""
    num_open_leases: int = 0
    """Hand-offs whose blocks may still be written (filled in when read)."""
    num_open_handles: int = 0
    """NIXL transfer handles this worker's agent holds (filled in when read)."""


class DecodeWorker(EngineReplica):
    """One engine replica behind Ray calls: generate (streaming), tokenize, status, kv_endpoint."""

    pool = "decode"
    follower_class = "decode_worker.rank:DecodeRank"

    def __init__(self, replica_id: str, engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
        super().__init__(replica_id, engine_config, worker_config)
        self.config = worker_config
        self.receiver: KVReceiver | None = None
        self.rank_endpoints: tuple[KVEndpoint, ...] = ()
        """Every rank's endpoint, rank 0 first (transport metadata included): what prefill workers connect to."""
        if worker_config.kv_transport != "none":
            self.receiver = _build_receiver(replica_id, self.engine, worker_config.kv_transport)
            opened = [f.open_kv.remote(worker_config.kv_transport, replica_id, self.engine.namespace) for f in self.tp_followers]
            self.rank_endpoints = (self.receiver.endpoint, *ray.get(opened))
        self._request_endpoints = tuple(replace(e, transport_metadata=b"") for e in self.rank_endpoints)
        """What a TransferRequest carries of each rank's endpoint: the same without the transport metadata."""
        self.transfers = TransferStats()
        self._cleanups: set[asyncio.Task] = set()
        self._prefill_peers: dict[str, object] = {}
        """Prefill replica id -> actor handle, as the controller announces them."""
        self.request_plane_server = RequestPlaneServer(replica_id, secrets.token_bytes(32), self._start_submitted, tls=worker_config.cluster_tls)
        self._request_plane_endpoint: asyncio.Future | None = None
        self.request_metrics = RequestTimingHistograms(self.metrics_labels)
        self.serve_metrics(
            CountersCollector("splitserve_kv_handoff", self.transfer_stats_now, self.metrics_labels, _GAUGES),
            CountersCollector("splitserve_request_plane", lambda: self.request_plane_server.stats, self.metrics_labels, frozenset({"num_open_channels"})),
            *self.request_metrics.collectors,
        )

    async def generate(
        self, request: pb.GenerateRequest, prefill=None, prefill_replica_id: str = "", resume_token_ids=()
    ) -> AsyncIterator[wpb.WorkerEvent]:
        """Stream WorkerEvents for ``request``: responses, or one RequestError before any response.

        ``prefill`` is a PrefillWorker handle to compute the prompt's KV, or None to compute it
        here. ``resume_token_ids`` continues a migrated request after the output it already
        streamed; its prompt and that output are prefilled here (from this replica's tiers where
        they hold the prefix).
        """
        reached = time.monotonic()
        timings = pb.Timings()
        first_token = None
        try:
            engine_request = to_engine_request(request, arrival_s=reached, resume_token_ids=resume_token_ids)
            if prefill is None or self.receiver is None or resume_token_ids:
                outputs = self.loop.generate(engine_request)
            else:
                outputs = self._generate_disaggregated(engine_request, prefill, prefill_replica_id or "prefill worker", timings)
            async for output in outputs:
                response = to_response(output)
                if first_token is None and output.new_token_ids:
                    first_token = time.monotonic() - reached
                if output.finished:
                    timings.worker_first_token_s = first_token or 0.0
                    timings.worker_total_s = time.monotonic() - reached
                    _trace_timings(timings, output.trace, reached)
                    response.timings.CopyFrom(timings)
                    self.request_metrics.observe(timings.admitted_s, timings.queue_s, timings.worker_first_token_s, timings.kv_handoff_s)
                yield wpb.WorkerEvent(response=response)
        except InvalidRequestError as e:
            yield _error(wpb.RequestError.INVALID_ARGUMENT, str(e))
        except AdmissionQueueFull as e:
            yield _error(wpb.RequestError.RESOURCE_EXHAUSTED, f"replica {self.replica_id}: {e}")
        except EngineLoopFailed as e:
            yield _error(wpb.RequestError.REPLICA_FAILED, f"replica {self.replica_id}: {e}")
        except RequestFailedError as e:  # this request's own failure: INTERNAL, which the router never migrates
            yield _error(wpb.RequestError.INTERNAL, f"replica {self.replica_id}: {e}")
        except RemotePrefillFailed as e:
            yield _error(e.code, f"replica {self.replica_id}: {e}")

    async def request_plane(self) -> wpb.RequestPlaneEndpoint:
        """Where routers open their channel for Generate traffic (request_plane.py), with the
        token it takes; the server starts on the first ask."""
        if self._request_plane_endpoint is None:
            host = self.config.request_plane_host or ray.util.get_node_ip_address()
            self._request_plane_endpoint = asyncio.ensure_future(self.request_plane_server.start(host, self.config.request_plane_port))
        return await asyncio.shield(self._request_plane_endpoint)

    async def request_plane_stats(self) -> RequestPlaneStats:
        return replace(self.request_plane_server.stats)

    async def add_prefill_peers(self, handles: dict[str, object]) -> None:
        """Prefill replicas (id -> handle) that requests submitted here may name."""
        self._prefill_peers.update(handles)

    async def remove_prefill_peer(self, replica_id: str) -> None:
        self._prefill_peers.pop(replica_id, None)

    def _start_submitted(self, submit: wpb.Submit) -> AsyncIterator[wpb.WorkerEvent]:
        prefill_id = submit.prefill_replica_id
        prefill = self._prefill_peers.get(prefill_id) if prefill_id else None
        if prefill_id and prefill is None:
            return self._unknown_prefill(submit.request, prefill_id)
        return self.generate(submit.request, prefill, prefill_id, tuple(submit.resume_token_ids))

    async def _unknown_prefill(self, request: pb.GenerateRequest, prefill_id: str) -> AsyncIterator[wpb.WorkerEvent]:
        """A request naming a prefill replica this worker has not been told of (it raced the
        controller's announcement, or the replica is gone): the failure policy applies."""
        self.transfers.num_failed += 1
        if self.config.remote_prefill_failure == "fail":
            yield _error(wpb.RequestError.UNAVAILABLE, f"replica {self.replica_id}: prefill worker {prefill_id} is unknown here")
            return
        logger.warning("replica %s: prefill worker %s is unknown here; prefilling locally", self.replica_id, prefill_id)
        self.transfers.num_recomputed += 1
        async for event in self.generate(request):
            yield event

    async def _generate_disaggregated(self, request: EngineRequest, prefill, prefill_id: str, timings: pb.Timings):
        limit = self.config.max_local_prefill_tokens

        def admit(engine: LLMEngine, r: EngineRequest) -> RemotePrefill | None:
            """Park for a remote prefill, or queue here: a prompt mostly cached here, too few free
            blocks, or a request asking for prompt logprobs (only the prefilling engine sees them)."""
            return engine.add_remote_request(
                r.request_id,
                r.prompt,
                r.params,
                messages=r.messages,
                tenant_salt=r.tenant_salt,
                max_local_prefill_tokens=limit,
                arrival_s=r.arrival_s,
            )

        outputs = self.loop.generate(request, admit)
        lease_unclaimed = True  # a call cancelled while its admission is in flight must still release the lease it may get
        try:
            slot = await anext(outputs)
            lease_unclaimed = False
            if slot is None:
                self.transfers.num_local_prefills += 1
            else:
                asked = time.monotonic()
                await self._remote_prefill(slot, request, prefill, prefill_id)
                timings.kv_handoff_s = time.monotonic() - asked
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()
            if lease_unclaimed:  # queued after the abort: by then the admission has run, or never will
                self._in_background(self.loop.call(lambda engine: engine.release_lease(request.request_id)))

    async def _remote_prefill(self, slot: RemotePrefill, request: EngineRequest, prefill, prefill_id: str) -> None:
        """Have ``prefill`` fill the slot's blocks, then join the batch; or apply the failure policy."""
        self.transfers.num_remote_prefills += 1
        decode, decode_ranks, waiting_ranks = self._hand_off_target(slot)
        transfer = TransferRequest(
            # One id per hand-off, not per request: a request re-submitted after its decode replica
            # died must never meet its first hand-off, still running on the same prefill worker.
            request_id=f"{slot.request_id}#{secrets.token_hex(4)}",
            decode=decode,
            block_ids=slot.block_ids,
            num_prompt_tokens=len(slot.prompt_token_ids),
            first_block_index=slot.first_block,
            timeout_s=self.config.kv_transfer_timeout_s,
            decode_ranks=decode_ranks,
        )
        wait_s = self.config.kv_transfer_timeout_s + _NOTIF_GRACE_S
        rank_waits = [self.tp_followers[r - 1].await_kv.remote(transfer.notif, wait_s) for r in waiting_ranks if r > 0]
        own = [self.receiver.expect(transfer.notif)] if 0 in waiting_ranks else []
        landed = asyncio.gather(*own, *(asyncio.ensure_future(ref) for ref in rank_waits))
        landed.add_done_callback(lambda f: f.cancelled() or f.exception())  # a hand-off given up: its ranks' waits end cancelled, unread
        ref = prefill.prefill.remote(transfer, list(slot.prompt_token_ids), _first_token_params(request.params), request.tenant_salt)
        answer = asyncio.ensure_future(ref)
        try:
            result = await self._await_hand_off(answer, landed, prefill_id)
        except RemotePrefillFailed as failure:
            self.transfers.num_failed += 1
            recompute = self.config.remote_prefill_failure == "recompute"
            logger.warning("replica %s: %s (%s)", self.replica_id, failure, "recomputing here" if recompute else "failing the request")
            await self.loop.call(lambda engine: engine.unpark_remote(slot.request_id, recompute))
            self._end_lease_when_over(slot.request_id, ref, answer, transfer.notif, rank_waits)
            if not recompute:
                raise
            self.transfers.num_recomputed += 1
            return
        except BaseException:  # the caller went away (cancel, disconnect, deadline) mid hand-off
            self._end_lease_when_over(slot.request_id, ref, answer, transfer.notif, rank_waits)
            raise
        self.transfers.num_blocks_received += len(slot.block_ids)
        self.transfers.num_bytes_received += result.num_bytes
        loop = self.loop

        def join(engine: LLMEngine) -> None:
            output = engine.join_remote(slot.request_id, result.first_token_id, _first_token_logprobs(result))
            engine.release_lease(slot.request_id)
            if output is not None:
                loop.deliver(output)

        await self.loop.call(join)

    def _hand_off_target(self, slot: RemotePrefill) -> tuple[KVEndpoint, tuple[KVEndpoint, ...], list[int]]:
        """``(decode endpoint, decode_ranks, ranks that wait)`` of a hand-off into ``slot``: every
        rank of a tensor-parallel replica (each holds some heads of the blocks), only the slot's
        rank of an expert-parallel one (each rank's pool holds requests of its own)."""
        if self.engine.config.ep_size > 1:
            return self._request_endpoints[slot.dp_rank], (), [slot.dp_rank]
        ranks = self._request_endpoints if len(self._request_endpoints) > 1 else ()
        return self._request_endpoints[0], ranks, list(range(len(self._request_endpoints)))

    async def _await_hand_off(self, answer: asyncio.Future, landed: asyncio.Future, prefill_id: str) -> TransferResult:
        """The prefill worker's successful answer once the write's notification is in; otherwise
        RemotePrefillFailed. The caller cleans up (lease, notification) on any exception."""
        timeout = self.config.kv_transfer_timeout_s
        try:
            result = await asyncio.wait_for(asyncio.shield(answer), timeout)
        except asyncio.TimeoutError:
            raise RemotePrefillFailed(wpb.RequestError.UNAVAILABLE, f"remote prefill on {prefill_id} timed out after {timeout} s") from None
        except _DEAD as e:
            raise RemotePrefillFailed(wpb.RequestError.UNAVAILABLE, f"prefill worker {prefill_id} died: {str(e).splitlines()[0]}") from e
        except RayTaskError as e:
            raise RemotePrefillFailed(wpb.RequestError.INTERNAL, f"remote prefill on {prefill_id} failed: {e.cause!r}") from e
        if not result.ok:
            code = wpb.RequestError.FAILED_PRECONDITION if result.error.startswith("KV hand-off") else wpb.RequestError.UNAVAILABLE
            raise RemotePrefillFailed(code, f"remote prefill on {prefill_id} {result.status.value}: {result.error}")
        try:
            await asyncio.wait_for(asyncio.shield(landed), _NOTIF_GRACE_S)
        except asyncio.TimeoutError:
            raise RemotePrefillFailed(
                wpb.RequestError.UNAVAILABLE, f"remote prefill on {prefill_id}: write reported done but no notification within {_NOTIF_GRACE_S} s"
            ) from None
        return result

    def _end_lease_when_over(self, request_id: str, ref, answer: asyncio.Future, notif: bytes, rank_waits=()) -> None:
        """Release the lease on the hand-off's blocks once the prefill side can no longer write
        them: its call has returned, failed, been cancelled, or its process is gone."""

        async def end() -> None:
            if not answer.done():
                ray.cancel(ref)  # the prefill worker aborts its compute or its write and returns
            try:
                await answer
            except (Exception, asyncio.CancelledError, TaskCancelledError):
                pass  # over, whichever way it ended
            self.receiver.forget(notif)
            for wait in rank_waits:
                ray.cancel(wait)  # each rank forgets the hand-off
            await self.loop.call(lambda engine: engine.release_lease(request_id))

        self._in_background(end())

    def _in_background(self, cleanup) -> None:
        """Run a cleanup coroutine to its end even though its caller is gone (shutdown cancels it)."""
        task = asyncio.get_running_loop().create_task(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def kv_endpoint(self) -> KVEndpoint | None:
        """Where prefill workers write this worker's KV (rank 0's pool); None when it takes no remote prefill."""
        return self.receiver.endpoint if self.receiver else None

    async def kv_endpoints(self) -> tuple[KVEndpoint, ...]:
        """Every rank's endpoint, rank 0 first; empty when it takes no remote prefill."""
        return self.rank_endpoints

    async def transfer_stats(self) -> TransferStats:
        return self.transfer_stats_now()

    def transfer_stats_now(self) -> TransferStats:
        return replace(
            self.transfers,
            num_open_leases=self.loop.stats.num_leases,
            num_open_handles=self.receiver.transport.num_open_handles() if self.receiver else 0,
        )

    async def tokenizer_files(self) -> dict[str, bytes]:
        """This checkpoint's tokenizer files by name (those of ``TOKENIZER_FILES`` it has): a
        router tokenizes prompts with a copy of them, so requests reach workers as token ids."""
        directory = self.engine.checkpoint_dir
        return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}

    async def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(**self.model_fields())

    async def status(self) -> pb.ReplicaStatus:
        """Liveness and load; a dead engine thread reports unhealthy."""
        return pb.ReplicaStatus(**await self.status_fields())

    async def shutdown(self) -> None:
        """Stop the request plane, the engine thread (requests still running are dropped with
        it) and the NIXL agent."""
        self.request_plane_server.close()
        for task in list(self._cleanups):
            task.cancel()
        await asyncio.gather(*(f.close_kv.remote() for f in self.tp_followers), return_exceptions=True)
        self.stop_engine()
        if self.receiver is not None:
            self.receiver.close()


def _trace_timings(timings: pb.Timings, trace: RequestTrace | None, reached: float) -> None:
    """The engine's trace of a request as Timings offsets from ``reached`` (0 where it never got there)."""
    if trace is None:
        return
    timings.admitted_s = trace.admitted_s - reached
    timings.prefill_steps = trace.prefill_steps
    timings.prefill_step_tokens = trace.prefill_step_tokens
    if trace.first_scheduled_s is not None:
        timings.queue_s = trace.first_scheduled_s - reached
    if trace.first_token_s is not None:
        timings.first_step_end_s = trace.first_token_s - reached


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """What the prefill worker samples with: the request's sampling (penalties, logit bias and
    log-probabilities included), one token. The decode worker applies the stop rules to the
    first token as to every other; the prefill worker stops after one token whatever it is, so
    its stop token ids and ``ignore_eos`` only say what min_tokens masks (``min_tokens`` 1 there
    when the request's is 1 or more: EOS and stop tokens cannot be the first token)."""
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(), prompt_logprobs=None)


def _first_token_logprobs(result: TransferResult) -> TokenLogprobs | None:
    """The first token's log-probabilities the prefill worker read, where the request asked."""
    if result.first_token_logprob is None:
        return None
    return TokenLogprobs(result.first_token_id, result.first_token_logprob, tuple(result.first_token_top_logprobs))


def _build_receiver(replica_id: str, engine: LLMEngine, transport_name: str) -> KVReceiver:
    transport, endpoint = open_endpoint(
        transport_name, replica_id, engine.kv_cache, engine.runner.model.shard.kv_heads, engine.namespace,
        layers=engine.runner.model.stage.layers, num_model_layers=engine.model_config.num_layers,
    )
    return KVReceiver(transport, endpoint)
