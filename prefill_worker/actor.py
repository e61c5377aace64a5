"""PrefillWorker: the Ray actor of one prefill replica.

For each hand-off it checks that the decode worker's pool can take its blocks, computes the
prompt (reusing its own prefix cache) as a one-token request whose blocks stay leased when it
finishes, writes the blocks the decode worker lacks into the decode worker's pool with one NIXL
WRITE, and answers with the first token (the decode side samples the rest with the same
per-position seeds, engine/sampler.py)::

    prefill(TransferRequest, tokens) ─ check_compatible ─ engine: prefill + sample 1 token (hold_kv)
                                     ─ WRITE own blocks [first_block_index:] -> decode block_ids
                                     ─ release the lease ─> TransferResult

Its pool keeps the same KV dtype as the decode pool (the hand-off refuses otherwise), so the
blocks are already in wire format: FP8 blocks were quantized, with their scales, when the engine
wrote them. Cancelling the call (the decode worker gave up) aborts the compute or the write, and
the call returns only once this side can no longer touch the decode worker's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError

from engine.config import EngineConfig
from engine.errors import AdmissionQueueFull, EngineLoopFailed, InvalidRequestError, RequestFailedError
from engine.metrics import CountersCollector, KeyedCounterCollector
from engine.params import SamplingParams
from engine.replica import EngineReplica
from engine.request import EngineRequest
from kv_transfer.errors import HandOffError, KVTransferError
from kv_transfer.handoff import plan_writes, write_rank
from kv_transfer.protocol import KVEndpoint, TransferRequest, TransferResult, TransferStatus, check_compatible
from kv_transfer.registry import open_endpoint
from prefill_worker.config import PrefillWorkerConfig
from proto import splitserve_pb2 as pb

if TYPE_CHECKING:  # annotations only: importing torch here would cost the controller, which imports this class
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_GAUGES = frozenset({"num_open_leases", "num_open_handles"})


@dataclass
class PrefillStats:
    """Counters of this worker's hand-offs (the sending side)."""

    num_prefills: int = 0
    """Hand-offs asked of this worker."""
    num_done: int = 0
    num_failed: int = 0
    """Hand-offs that ended in an error (refusals included) or a timeout."""
    num_refused: int = 0
    """Hand-offs refused because the two pools cannot exchange blocks."""
    num_cancelled: int = 0
    """Hand-offs the decode worker gave up on (timeout, client gone) while they ran here."""
    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    num_open_leases: int = 0
    """Prefilled requests whose blocks may still be read by a write (filled in when read)."""
    num_open_handles: int = 0
    """NIXL transfer handles not yet released (filled in when read)."""


@dataclass
class FaultPlan:
    """Faults to inject into the next hand-offs, for failure testing (``inject_faults``)."""

    fail_next: int = 0
    """The next this-many hand-offs fail after computing, before writing."""
    delay_s: float = 0.0
    """Every hand-off waits this long between computing and writing."""


class PrefillWorker(EngineReplica):
    """Computes prompts and writes their KV blocks into decode workers' pools."""

    pool = "prefill"
    follower_class = "prefill_worker.rank:PrefillRank"

    def __init__(self, replica_id: str, engine_config: EngineConfig, config: PrefillWorkerConfig) -> None:
        super().__init__(replica_id, engine_config, config)
        self.config = config
        self.transport, self.endpoint = open_endpoint(
            config.kv_transport, replica_id, self.engine.kv_cache, self.engine.runner.model.shard.kv_heads, self.engine.namespace,
            layers=self.engine.runner.model.stage.layers, num_model_layers=self.engine.model_config.num_layers,
        )
        opened = [f.open_kv.remote(config.kv_transport, replica_id, self.engine.namespace) for f in self.tp_followers]
        self.rank_endpoints: tuple[KVEndpoint, ...] = (self.endpoint, *ray.get(opened))
        """Every rank's endpoint, rank 0 first: which KV heads each holds."""
        self.stats = PrefillStats()
        self.rank_bytes: dict[tuple[int, int], int] = {}
        """Bytes written per (prefill rank, decode rank) pair, over every hand-off."""
        self.faults = FaultPlan()
        self.serve_metrics(
            CountersCollector("splitserve_kv_handoff", self.transfer_stats_now, self.metrics_labels, _GAUGES),
            KeyedCounterCollector(
                "splitserve_kv_handoff_rank_bytes", "Bytes of KV this prefill rank wrote into that decode rank.",
                lambda: dict(self.rank_bytes), self.metrics_labels, ("tp_rank", "decode_rank"),
            ),
        )

    async def prefill(
        self, transfer: TransferRequest, prompt_token_ids: list[int], params: SamplingParams, tenant_salt: str | None = None
    ) -> TransferResult:
        """Compute the prompt, write its blocks ``transfer.first_block_index:`` into the decode pool."""
        self.stats.num_prefills += 1
        request_id = transfer.request_id
        try:
            for decode in transfer.decode_endpoints:
                check_compatible(self.endpoint, decode)
            plan = plan_writes(tuple(e.shard for e in self.rank_endpoints), tuple(e.shard for e in transfer.decode_endpoints), self.endpoint.num_model_layers)
            if len(prompt_token_ids) != transfer.num_prompt_tokens:
                raise KVTransferError(
                    f"prompt_token_ids: {len(prompt_token_ids)} tokens, the transfer request says {transfer.num_prompt_tokens}"
                )
        except KVTransferError as e:
            self.stats.num_refused += isinstance(e, HandOffError)
            return self._failed(request_id, TransferStatus.FAILED, str(e))
        try:
            return await self._prefill_and_write(transfer, plan, prompt_token_ids, params, tenant_salt)
        except (KVTransferError, InvalidRequestError, AdmissionQueueFull, EngineLoopFailed, RequestFailedError) as e:
            return self._failed(request_id, TransferStatus.FAILED, f"{type(e).__name__}: {e}")
        except asyncio.CancelledError:
            self.stats.num_cancelled += 1
            raise
        finally:
            if self.loop.alive:
                await self.loop.call(lambda engine: engine.release_lease(request_id))

    async def _prefill_and_write(self, transfer: TransferRequest, plan, prompt_token_ids, params, tenant_salt) -> TransferResult:
        request_id = transfer.request_id
        deadline = time.monotonic() + transfer.timeout_s

        def admit(engine: LLMEngine, r: EngineRequest) -> None:
            engine.add_request(r.request_id, r.prompt, r.params, tenant_salt=r.tenant_salt, hold_kv=True, arrival_s=r.arrival_s)

        first_logprobs = None
        async for output in self.loop.generate(EngineRequest(request_id, list(prompt_token_ids), None, params, tenant_salt), admit):
            if output is not None and output.logprobs:  # the admission (None), then the one output that finishes it
                first_logprobs = output.logprobs[0]
        done, num_runs = await self.loop.call(lambda engine: (engine.take_prefilled(request_id), engine.runner.num_runs))
        await self._apply_faults(request_id)
        if time.monotonic() > deadline:  # the decode worker has given up: write nothing into its pool
            return self._failed(request_id, TransferStatus.TIMED_OUT, f"prompt not computed within {transfer.timeout_s} s")
        for w in plan:
            peer = transfer.decode_endpoints[w.decode_rank].agent_name
            if w.prefill_rank == 0 and not self.transport.has_peer(peer):
                raise KVTransferError(f"decode agent {peer!r} is unknown here: its endpoint never reached this worker (add_kv_peers)")
        source = done.block_ids[transfer.first_block_index :]
        started = time.perf_counter()
        try:
            writes = await self._write_all_ranks(transfer, plan, source, num_runs, deadline)
        except KVTransferError as e:
            status = TransferStatus.TIMED_OUT if time.monotonic() > deadline else TransferStatus.FAILED
            return self._failed(request_id, status, str(e))
        num_bytes = sum(w.num_bytes for w in writes)
        for w in writes:
            pair = (w.prefill_rank, w.decode_rank)
            self.rank_bytes[pair] = self.rank_bytes.get(pair, 0) + w.num_bytes
        self.stats.num_done += 1
        self.stats.num_blocks_sent += len(source)
        self.stats.num_bytes_sent += num_bytes
        return TransferResult(
            request_id=request_id,
            status=TransferStatus.DONE,
            block_ids=transfer.block_ids,
            first_token_id=done.first_token,
            first_token_logprob=first_logprobs.logprob if first_logprobs is not None else None,
            first_token_top_logprobs=first_logprobs.top if first_logprobs is not None else (),
            num_cached_tokens=done.num_cached_tokens,
            num_bytes=num_bytes,
            transfer_s=time.perf_counter() - started,
            rank_writes=writes,
        )

    async def _write_all_ranks(self, transfer: TransferRequest, plan, source, num_runs: int, deadline: float) -> tuple:
        """Every rank posts its own writes at once; returns once all are done, or raises once
        none can land any more (a rank that is cancelled or fails releases its writes)."""
        remaining = max(0.0, deadline - time.monotonic())
        refs = [
            f.write_kv.remote(transfer, [w for w in plan if w.prefill_rank == rank], source, num_runs, remaining)
            for rank, f in enumerate(self.tp_followers, start=1)
            if any(w.prefill_rank == rank for w in plan)
        ]
        followers = [asyncio.ensure_future(ref) for ref in refs]
        own = asyncio.ensure_future(write_rank(self.transport, transfer, [w for w in plan if w.prefill_rank == 0], self.endpoint, source, deadline))
        try:
            results = await asyncio.gather(own, *followers)
        except BaseException as e:
            for ref in refs:
                ray.cancel(ref)
            own.cancel()
            await asyncio.gather(own, *followers, return_exceptions=True)  # every write released before this returns
            if isinstance(e, (RayTaskError, RayActorError, TaskCancelledError)):
                raise KVTransferError(f"a rank's write failed: {getattr(e, 'cause', None) or e}") from e
            raise
        return tuple(w for rank_writes in results for w in rank_writes)

    async def _apply_faults(self, request_id: str) -> None:
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        if self.faults.fail_next > 0:
            self.faults.fail_next -= 1
            raise KVTransferError(f"injected failure of the hand-off of request {request_id!r}")

    def _failed(self, request_id: str, status: TransferStatus, error: str) -> TransferResult:
        self.stats.num_failed += 1
        logger.warning("prefill worker %s: hand-off of %s %s: %s", self.replica_id, request_id, status.value, error)
        return TransferResult(request_id=request_id, status=status, error=error)

    async def add_kv_peers(self, endpoints: list[KVEndpoint]) -> None:
        """Connect every rank to decode workers' pools (their ranks' endpoints, as published through the controller)."""
        for endpoint in endpoints:
            self.transport.add_peer(endpoint.transport_metadata)
        await asyncio.gather(*(f.add_kv_peers.remote(endpoints) for f in self.tp_followers))

    async def remove_kv_peers(self, agent_names: list[str]) -> None:
        """Forget the ranks of a decode worker that left the cluster."""
        for name in agent_names:
            if self.transport.has_peer(name):
                self.transport.remove_peer(name)
        await asyncio.gather(*(f.remove_kv_peers.remote(agent_names) for f in self.tp_followers), return_exceptions=True)

    async def remove_kv_peer(self, agent_name: str) -> None:
        """Forget one decode agent (``remove_kv_peers`` of one name)."""
        await self.remove_kv_peers([agent_name])

    async def inject_faults(self, fail_next: int = 0, delay_s: float = 0.0) -> None:
        """Make the next ``fail_next`` hand-offs fail and every hand-off wait ``delay_s`` before
        writing. For failure testing; a production deployment never calls it."""
        self.faults = FaultPlan(fail_next, delay_s)

    async def kv_endpoint(self) -> KVEndpoint:
        return self.endpoint

    async def kv_endpoints(self) -> tuple[KVEndpoint, ...]:
        """Every rank's endpoint, rank 0 first."""
        return self.rank_endpoints

    async def transfer_stats(self) -> PrefillStats:
        return self.transfer_stats_now()

    async def rank_bytes_sent(self) -> dict[tuple[int, int], int]:
        """Bytes written per (prefill rank, decode rank) pair since start."""
        return dict(self.rank_bytes)

    def transfer_stats_now(self) -> PrefillStats:
        return replace(self.stats, num_open_leases=self.loop.stats.num_leases, num_open_handles=self.transport.num_open_handles())

    async def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(**self.model_fields())

    async def status(self) -> pb.ReplicaStatus:
        return pb.ReplicaStatus(**await self.status_fields())

    async def shutdown(self) -> None:
        await asyncio.gather(*(f.close_kv.remote() for f in self.tp_followers), return_exceptions=True)
        self.stop_engine()
        self.transport.close()
