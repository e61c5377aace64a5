"""A stand-in router in its own process, for the client's failover tests: ``python -m
tests.unit.router.dying_router --stall-after K`` serves Generation on a free loopback port,
prints it, and stops answering after sending K messages of its first call, for the test to kill
it (SIGKILL: the kernel resets its connections) once the client has read them all; K = 0 exits
at once instead (``os._exit``, nothing having been sent); -1 (the default): serve on.

Its "model" answers token ``i`` of a prompt as a pure function of the prompt, the seed and ``i``,
so a resumed answer can be compared with an undisturbed one. It checks resumes with the real
router's tags (router.frontend.validation) and answers a resume it cannot verify as a router does. Every
call it took is printed as one JSON line on stderr (the test reads what the client sent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from concurrent import futures

import grpc

from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from router.client import ROUTER_ERROR_ORIGIN
from router.config import RouterConfig
from router.errors import CallRejected
from router.frontend.validation import ResumeTagger, check_resume, is_greedy, resume_key

VOCAB_SIZE = 1000
SEED_CHOSEN = 4242
"""The seed this router gives a sampled request that has none."""


def token(prompt: list[int], seed: int | None, i: int) -> int:
    return (sum(prompt) * 31 + (seed or 0) * 17 + i * 7919) % VOCAB_SIZE


class DyingGeneration(pb_grpc.GenerationServicer):
    def __init__(self, stall_after: int, refuse: str) -> None:
        self.stall_after = stall_after
        self.refuse = refuse
        self.num_sent = 0
        self.key = resume_key(RouterConfig(port=0))

    def Generate(self, request, context):
        remaining = context.time_remaining()
        print(json.dumps({
            "request_id": request.request_id,
            "seed": request.sampling.seed if request.sampling.HasField("seed") else None,
            "resume": list(request.resume.token_ids),
            "time_remaining_s": remaining,
        }), file=sys.stderr, flush=True)
        if self.refuse:
            code = grpc.StatusCode[self.refuse]
            context.abort(code, f"router refuses: {self.refuse}")  # trailing metadata set below
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.ClearField("resume")
        if not is_greedy(request.sampling) and not forwarded.sampling.HasField("seed") and not request.resume.token_ids:
            forwarded.sampling.seed = SEED_CHOSEN
        seed = forwarded.sampling.seed if forwarded.sampling.HasField("seed") else None
        tagger = ResumeTagger(self.key, forwarded)
        start = len(request.resume.token_ids)
        if start:
            try:
                check_resume(request, request.resume, VOCAB_SIZE, tagger)
            except CallRejected as rejected:
                context.set_trailing_metadata((ROUTER_ERROR_ORIGIN,))
                context.abort(rejected.code, rejected.message)
            expected = [token(list(request.prompt_token_ids), seed, i) for i in range(start)]
            if list(request.resume.token_ids) != expected:
                context.abort(grpc.StatusCode.INTERNAL, f"resumed tokens {list(request.resume.token_ids)} are not the answer's {expected}")
        request_id = request.request_id or "fake-request-id"
        max_tokens = request.stop.max_tokens
        for i in range(start, max_tokens):
            if self.num_sent == self.stall_after == 0:
                os._exit(9)
            if self.num_sent == self.stall_after:
                threading.Event().wait()  # until the test kills this process
            t = token(list(request.prompt_token_ids), seed, i)
            tagger.add([t])
            response = pb.GenerateResponse(request_id=request_id, text=f"<{t}>", token_ids=[t], resume_tag=tagger.tag())
            if i == start and seed is not None:
                response.seed = seed
            if i == max_tokens - 1:
                response.finish_reason = pb.FINISH_REASON_LENGTH
                response.usage.completion_tokens = max_tokens
            self.num_sent += 1
            yield response

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="fake", vocab_size=VOCAB_SIZE)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stall-after", type=int, default=-1)
    parser.add_argument("--refuse", default="", help="answer every call with this status code, as the router itself")
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = DyingGeneration(args.stall_after, args.refuse)
    if args.refuse:
        servicer.Generate = _with_router_metadata(servicer.Generate)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _with_router_metadata(generate):
    def wrapped(request, context):
        context.set_trailing_metadata((ROUTER_ERROR_ORIGIN,))
        yield from generate(request, context)

    return wrapped


if __name__ == "__main__":
    main()
