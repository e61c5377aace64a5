"""llama.cpp as bench.engine's peer: the same GGUF file, threads and token ids, in this process.

It runs through llama-cpp-python's low-level API (``make bench-peers`` builds it from source for
this CPU), the way llama.cpp's own server serves several streams: one context whose KV cache
holds a sequence id per stream, and each ``llama_decode`` a batch of every running stream's next
token plus the next prompt chunks of those that joined (continuous batching). Greedy sampling is
llama.cpp's own greedy sampler, so no logits cross into Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import BenchError
from bench.workload import BenchRequest

INSTALL_HINT = (
    "llama.cpp is not installed in this environment: run `make bench-peers` "
    "(builds llama-cpp-python from source, several minutes), or leave llama.cpp out of --systems"
)
NUM_BATCH_TOKENS = 2048
"""Tokens one ``llama_decode`` may carry, as llama.cpp's server (``-b``); prompts are chunked to fit."""


def import_llama_cpp():
    """The ``llama_cpp`` module, or BenchError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:  # the package is missing, or its shared library does not load
        raise BenchError(INSTALL_HINT) from None
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load log would bury the progress lines
    return llama_cpp


@dataclass
class _Stream:
    """One request being served: the sequence id it holds in the context and how far it has got."""

    index: int
    request: BenchRequest
    submitted_s: float
    num_prompt_done: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def last_position(self) -> int:
        """Position of the newest output token, the one the next decode step feeds."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids) - 1

    @property
    def done(self) -> bool:
        return len(self.output_token_ids) >= self.request.num_output_tokens


@dataclass(frozen=True)
class PeerRun:
    """What serving a workload took: tokens, wall time, first-token delays, each request's greedy output."""

    num_output_tokens: int
    wall_s: float
    ttfts_s: list[float]
    output_token_ids: list[list[int]]


class LlamaCppPeer:
    """One llama.cpp model and context with room for ``max_num_seqs`` streams of ``max_seq_len`` tokens.

    Call ``close`` when done: the model and the KV cache live in native memory.
    """

    def __init__(self, gguf_path: Path, num_threads: int, max_num_seqs: int, max_seq_len: int) -> None:
        self.lib = lib = import_llama_cpp()
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise BenchError(f"llama.cpp could not load {gguf_path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size: int = lib.llama_vocab_n_tokens(self.vocab)
        self.max_num_seqs, self.num_threads = max_num_seqs, num_threads
        params = lib.llama_context_default_params()
        params.n_seq_max = max_num_seqs
        params.n_ctx = max_num_seqs * max_seq_len  # split evenly between the sequences (kv_unified off)
        params.kv_unified = False  # llama.h: faster when the sequences share no prefix, as here
        params.n_batch = NUM_BATCH_TOKENS
        params.n_threads = params.n_threads_batch = num_threads
        self.flash_attn = lib.llama_flash_attn_type_name(params.flash_attn_type).decode()
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise BenchError(f"llama.cpp could not make a context of {params.n_ctx} tokens for {gguf_path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(NUM_BATCH_TOKENS, 0, 1)
        self.sampler = lib.llama_sampler_init_greedy()

    def close(self) -> None:
        """Free the sampler, batch, context and model."""
        self.lib.llama_sampler_free(self.sampler)
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def describe(self) -> dict:
        """What the JSON report says of this peer: its version, threads, attention, the build's CPU features."""
        return {
            "version": self.lib.__version__,
            "threads": self.num_threads,
            "flash_attn": self.flash_attn,
            "system_info": self.lib.llama_print_system_info().decode().strip(),
        }

    def tokenize(self, text: str) -> list[int]:
        """``text`` split by llama.cpp's own tokenizer, adding no BOS/EOS; control tokens spelled
        in the text become their ids, as in splitserve's (Hugging Face) tokenizer."""
        data = text.encode()
        ids = (self.lib.llama_token * (len(data) + 8))()
        num_ids = self.lib.llama_tokenize(self.vocab, data, len(data), ids, len(ids), False, True)
        return list(ids[:num_ids])

    def serve(self, workload: Sequence[BenchRequest], concurrency: int) -> PeerRun:
        """Serve ``workload`` greedily (EOS ignored) as a closed loop of ``concurrency`` streams,
        continuously batched; concurrency 1 serves the requests one after another."""
        if concurrency > self.max_num_seqs:
            raise ValueError(f"concurrency {concurrency} exceeds the context's {self.max_num_seqs} sequences")
        self.lib.llama_memory_clear(self.memory, True)
        queue = list(enumerate(workload))
        free_seq_ids = list(range(concurrency - 1, -1, -1))
        running: dict[int, _Stream] = {}
        outputs: list[list[int]] = [[] for _ in workload]
        ttfts: list[float] = []
        start = time.perf_counter()
        while queue or running:
            while queue and free_seq_ids:
                index, request = queue.pop(0)
                running[free_seq_ids.pop()] = _Stream(index, request, time.perf_counter())
            for stream in self._step(running):
                ttfts.append(time.perf_counter() - stream.submitted_s)
            for seq_id, stream in list(running.items()):
                if stream.done:
                    outputs[stream.index] = stream.output_token_ids
                    self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                    free_seq_ids.append(seq_id)
                    del running[seq_id]
        return PeerRun(sum(len(o) for o in outputs), time.perf_counter() - start, ttfts, outputs)

    def prefill(self, prompt_token_ids: Sequence[int]) -> int:
        """Prefill ``prompt_token_ids`` (at most ``NUM_BATCH_TOKENS``) into an empty cache in one
        ``llama_decode``; the greedy first token."""
        self.lib.llama_memory_clear(self.memory, True)
        stream = _Stream(0, BenchRequest(tuple(prompt_token_ids), 1), time.perf_counter())
        self._step({0: stream})
        return stream.output_token_ids[0]

    def decode_s(self, prompt_token_ids: Sequence[int], num_output_tokens: int) -> float:
        """Seconds one stream takes from its first output token to its last (``num_output_tokens``
        in all): pure decode at concurrency 1."""
        self.lib.llama_memory_clear(self.memory, True)
        running = {0: _Stream(0, BenchRequest(tuple(prompt_token_ids), num_output_tokens), time.perf_counter())}
        self._step(running)
        started = time.perf_counter()
        while not running[0].done:
            self._step(running)
        return time.perf_counter() - started

    def _step(self, running: dict[int, _Stream]) -> list[_Stream]:
        """Fill the batch (decode tokens first, then prompt chunks up to the batch size), decode it,
        and sample one token for every stream whose last batch row asks for logits."""
        batch, num_tokens, sample_rows = self.batch, 0, []
        decoding = [(s, st) for s, st in running.items() if st.num_prompt_done == len(st.request.prompt_token_ids)]
        prefilling = [(s, st) for s, st in running.items() if st.num_prompt_done < len(st.request.prompt_token_ids)]
        for seq_id, stream in decoding:
            self._put(num_tokens, stream.output_token_ids[-1], stream.last_position, seq_id, True)
            sample_rows.append((num_tokens, stream))
            num_tokens += 1
        for seq_id, stream in prefilling:
            prompt = stream.request.prompt_token_ids
            take = min(len(prompt) - stream.num_prompt_done, NUM_BATCH_TOKENS - num_tokens)
            for offset in range(take):
                position = stream.num_prompt_done + offset
                self._put(num_tokens, prompt[position], position, seq_id, position == len(prompt) - 1)
                num_tokens += 1
            stream.num_prompt_done += take
            if stream.num_prompt_done == len(prompt):
                sample_rows.append((num_tokens - 1, stream))
        batch.n_tokens = num_tokens
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise BenchError(f"llama.cpp's llama_decode failed with status {status} on a batch of {num_tokens} tokens")
        first = []
        for row, stream in sample_rows:
            if not stream.output_token_ids:
                first.append(stream)
            stream.output_token_ids.append(self.lib.llama_sampler_sample(self.sampler, self.ctx, row))
        return first

    def _put(self, row: int, token_id: int, position: int, seq_id: int, wants_logits: bool) -> None:
        batch = self.batch
        batch.token[row] = token_id
        batch.pos[row] = position
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = seq_id
        batch.logits[row] = wants_logits
