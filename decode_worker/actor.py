"""DecodeWorker: the Ray actor of one decode replica.

In aggregated mode it prefills its own requests. The controller creates it from its import path
(`decode_worker.actor:DecodeWorker`) with the pool's custom resource, so the router never imports
this module.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from decode_worker.config import WorkerConfig
from decode_worker.engine_loop import AdmissionQueueFull, EngineLoop, EngineLoopFailed
from decode_worker.metrics import EngineStatsCollector, serve_metrics
from decode_worker.requests import to_engine_request, to_response
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb


def _error(code: int, message: str) -> wpb.WorkerEvent:
    return wpb.WorkerEvent(error=wpb.RequestError(code=code, message=message))


class DecodeWorker:
    """One engine replica behind Ray calls: generate (streaming), tokenize, status."""

    def __init__(self, replica_id: str, engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
        num_threads = worker_config.num_threads or len(os.sched_getaffinity(0))
        self.replica_id = replica_id
        self.loop = EngineLoop(lambda: LLMEngine(engine_config), worker_config.max_waiting_requests, num_threads)
        self.loop.start()
        self.engine = self.loop.engine
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(lambda: self.loop.stats, {"replica": replica_id, "pool": "decode"}))
        self.metrics_url = serve_metrics(registry, worker_config.metrics_host, worker_config.metrics_port)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[wpb.WorkerEvent]:
        """Stream WorkerEvents for ``request``: responses, or one RequestError before any response."""
        try:
            engine_request = to_engine_request(request)
            async for output in self.loop.generate(engine_request):
                yield wpb.WorkerEvent(response=to_response(output))
        except InvalidRequestError as e:
            yield _error(wpb.RequestError.INVALID_ARGUMENT, str(e))
        except AdmissionQueueFull as e:
            yield _error(wpb.RequestError.RESOURCE_EXHAUSTED, f"replica {self.replica_id}: {e}")
        except EngineLoopFailed as e:
            yield _error(wpb.RequestError.UNAVAILABLE, f"replica {self.replica_id}: {e}")

    async def tokenize(self, request: pb.TokenizeRequest) -> wpb.TokenizeResult:
        tokenizer = self.engine.tokenizer
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = tokenizer.encode(request.prompt, add_special_tokens=add_special)
        return wpb.TokenizeResult(response=pb.TokenizeResponse(token_ids=ids))

    async def model_info(self) -> pb.ModelInfo:
        engine = self.engine
        return pb.ModelInfo(
            id=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            kv_dtype=engine.config.kv_dtype,
            block_size=engine.config.block_size,
        )

    async def status(self) -> pb.ReplicaStatus:
        """Liveness and load; a dead engine thread reports unhealthy."""
        s = self.loop.stats
        return pb.ReplicaStatus(
            replica_id=self.replica_id,
            pool="decode",
            model=self.engine.model_name,
            healthy=self.loop.alive,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks,
            metrics_url=self.metrics_url,
            num_aborted_requests=s.num_aborted_requests,
        )

    async def shutdown(self) -> None:
        """Stop the engine thread (requests still running are dropped with it)."""
        self.loop.stop()
