"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.cpus import parse_cpu_list
from kv_store.keys import KV_DTYPES

MODEL_DTYPES = ("float32", "bfloat16")
WEIGHT_FORMATS = ("native", "bf16", "fp32", "int8", "int4")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
ACT_PLANES = (1, 2)
"""Activation planes the quantized CPU kernel runs (``act_planes``): 2, about 15 bits of each, or 1, 8 bits."""
DEVICE_WEIGHTS = {"float32": ("fp32",), "bfloat16": ("bf16",)}
"""Weights each model dtype runs with on a GPU (``device`` cuda): dense only; the quantized
kernels (int8, int4, native GGUF blocks) are CPU code."""


@dataclass(frozen=True)
class EngineConfig:
    """What to load and how to size the KV pool and the batch."""

    model: str = "smollm2-135m"
    """A bundled model name or a path to a Hugging Face checkpoint directory."""
    dtype: str = "float32"
    """Weights and activations: float32 or bfloat16."""
    weights: str = "native"
    """Linear-layer weights: native (kept at the checkpoint's own precision: a GGUF's quantized
    blocks run as weight-only quantized matmuls, a safetensors checkpoint as stored), bf16, fp32,
    or int8/int4 (weight-only, quantized at load)."""
    act_planes: int = 2
    """int8 planes the quantized CPU kernel cuts each 32-block of activations into: 2 (about 15
    bits; perplexity as fp32's) or 1 (llama.cpp's 8-bit activations: half the integer work, about
    1% more perplexity on SmolLM2). Only weights the C kernel runs take it (native GGUF blocks,
    int8, int4)."""
    device: str = "cpu"
    """Where the model and the KV pool live: ``cpu``, or ``cuda`` / ``cuda:N`` (dense weights; the
    device path: fused Triton kernels, CUDA-graph decode steps, NCCL between ranks, one GPU per rank)."""
    kv_dtype: str = "fp8_e4m3"
    """KV pool storage: fp32, bf16 or fp8_e4m3 (dequantized inside attention)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_bytes: int = 1 << 30
    """Bytes of KV pool to allocate when num_kv_blocks is not set."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides kv_cache_bytes."""
    max_num_seqs: int = 64
    """Most sequences in the running batch."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; longer prompts are prefilled in chunks of at most this."""
    max_model_len: int | None = None
    """Longest prompt plus output; None takes the model's context length."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks of a prompt's prefix."""
    seed: int = 0
    """Seeds sampling for requests that do not bring their own seed."""
    cache_dir: Path | None = None
    """Where bundled models are converted to; None is $SPLITSERVE_CACHE_DIR or ~/.cache/splitserve."""
    cpu_kv_cache_bytes: int = 0
    """Bytes of host memory for the CPU tier that evicted pool blocks spill to; 0 disables it."""
    redis_url: str | None = None
    """Redis tier shared by the cluster: redis://[:password@]host:port/db or rediss:// (TLS); None disables it."""
    redis_ttl_s: int = 3600
    """Seconds a block lives in the Redis tier."""
    redis_tls_ca_file: Path | None = None
    """CA certificate of the Redis server, for rediss:// URLs."""
    tp_size: int = 1
    """Tensor-parallel ranks the model is split over (one process each); the model's heads must allow it."""
    ep_size: int = 1
    """Expert-parallel ranks (MoE models): each holds 1/N of the experts and runs attention for
    requests of its own (data-parallel attention); exclusive with tp_size > 1."""
    pp_size: int = 1
    """Pipeline stages: each holds a contiguous run of the layers (``tp_size`` ranks each), passes
    hidden states to the next, and keeps up to this many micro-batches in flight
    (engine/parallel/pipeline.py); a replica is ``pp_size x tp_size`` ranks."""
    speculative: str = "off"
    """Speculative decoding: off, ngram (drafts copied from the sequence's own earlier tokens) or
    draft (a small draft model, ``draft_model``); drafts are verified in one batched forward pass."""
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per sequence and step."""
    draft_model: str | None = None
    """The draft model for ``speculative="draft"``: a bundled name or a checkpoint directory."""
    ngram_min_match: int = 2
    """Shortest tail of the sequence that n-gram drafting looks up earlier in it."""
    ngram_max_match: int = 4
    """Longest tail tried first by n-gram drafting."""
    spec_token_cost: float = 0.2
    """Marginal cost of one more token in a step, in decode steps of one sequence: drafting stops
    for a sequence whose acceptance does not cover it (``engine/spec/policy.py``). Measured on
    SmolLM2 (native weights, one thread, 200 tokens of context): a chunk of 2 / 3 / 5 tokens
    took 1.13x / 1.29x / 1.82x a one-token decode step."""
    spec_chunk_cost: float = 0.16
    """Cost of verifying a sequence in a chunk of its own beside other decoding sequences (its
    attention leaves their shared call), in one-sequence decode steps. Measured on SmolLM2 as
    above: 7 decodes and a 1-token chunk took 1.06x 8 decodes (3.7 ms; 22.7 ms a decode step)."""
    tp_collective_timeout_s: float = 30.0
    """How long a rank waits in an all-reduce for the others before the replica fails (a hung rank)."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs for decode steps (as vLLM's ``--enforce-eager``)."""
    graph_max_batch: int | None = None
    """Largest decode batch replayed as a CUDA graph (buckets 1, 2, 4, 8, then every 8 up to it);
    None takes ``max_num_seqs``. A larger decode batch runs eagerly."""
    grammar_compile_timeout_s: float = 10.0
    """A request's constraint (JSON Schema, regex, grammar) that does not compile within this is
    refused (INVALID_ARGUMENT naming the field); compiling never runs on the engine's step."""
    grammar_cache_size: int = 256
    """Compiled constraints kept for reuse, least recently used dropped first."""

    @property
    def num_ranks(self) -> int:
        """Processes of one replica: its PP x TP size, or its EP size."""
        return self.pp_size * max(self.tp_size, self.ep_size)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {MODEL_DTYPES}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights: {self.weights!r} is not one of {WEIGHT_FORMATS}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative: {self.speculative!r} is not one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model: set it exactly when speculative is 'draft'")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(f"ngram_min_match, ngram_max_match: need 1 <= min <= max, got {self.ngram_min_match} and {self.ngram_max_match}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s: must be > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size: must be >= 1, got {self.grammar_cache_size}")
        if not self.spec_token_cost >= 0:
            raise ValueError(f"spec_token_cost: must be >= 0, got {self.spec_token_cost}")
        if not self.spec_chunk_cost >= 0:
            raise ValueError(f"spec_chunk_cost: must be >= 0, got {self.spec_chunk_cost}")
        if self.speculative != "off" and self.num_ranks > 1:
            raise ValueError(f"speculative: {self.speculative!r} runs on replicas of one rank only; set tp_size, ep_size and pp_size to 1 or speculative to 'off'")
        if self.act_planes not in ACT_PLANES:
            raise ValueError(f"act_planes: {self.act_planes} activation planes; the quantized kernel runs 1 or 2")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {KV_DTYPES}")
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.graph_max_batch is not None and self.graph_max_batch < 1:
            raise ValueError(f"graph_max_batch: must be >= 1, got {self.graph_max_batch}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.cpu_kv_cache_bytes < 0:
            raise ValueError(f"cpu_kv_cache_bytes: must be >= 0, got {self.cpu_kv_cache_bytes}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: {self.redis_url!r} is not a redis://, rediss:// or unix:// URL")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size: must be >= 1, got {self.ep_size}")
        if self.tp_size > 1 and self.ep_size > 1:
            raise ValueError(f"ep_size: a replica is tensor-parallel or expert-parallel, not both (tp_size {self.tp_size}, ep_size {self.ep_size})")
        if self.pp_size < 1:
            raise ValueError(f"pp_size: must be >= 1, got {self.pp_size}")
        if self.pp_size > 1 and self.ep_size > 1:
            raise ValueError(f"pp_size: pipeline stages hold dense or tensor-parallel layers so far, not expert-parallel ones (ep_size {self.ep_size}); set one of them to 1")
        if self.pp_size > 1 and (self.cpu_kv_cache_bytes or self.redis_url is not None):
            raise ValueError("pp_size: the CPU and Redis KV tiers serve replicas of one stage so far; set pp_size to 1 or disable the tiers")
        if self.device != "cpu":
            self._check_device()
        if not self.tp_collective_timeout_s > 0:
            raise ValueError(f"tp_collective_timeout_s: must be > 0, got {self.tp_collective_timeout_s}")
        if self.redis_ttl_s < 1:
            raise ValueError(f"redis_ttl_s: must be >= 1, got {self.redis_ttl_s}")

    def _check_device(self) -> None:
        if re.fullmatch(r"cuda(:\d+)?", self.device) is None:
            raise ValueError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if self.weights not in DEVICE_WEIGHTS[self.dtype]:
            supported = "; ".join(f"dtype {d}: weights {', '.join(w)}" for d, w in DEVICE_WEIGHTS.items())
            raise ValueError(f"weights: {self.weights!r} with dtype {self.dtype!r} does not run on {self.device} (supported there: {supported})")
        if self.act_planes != 2:
            raise ValueError(f"act_planes: {self.act_planes} sets the quantized CPU kernel, which does not run on {self.device}; leave it at 2")
        if self.speculative == "draft":
            raise ValueError(f"speculative: 'draft' does not run on {self.device} so far (its draft model is CPU-only); set speculative to off or ngram")


@dataclass(frozen=True)
class WorkerProcessConfig:
    """What every worker process (prefill or decode) needs besides its engine."""

    max_waiting_requests: int = 256
    """Requests waiting for a batch slot beyond which new ones are refused (RESOURCE_EXHAUSTED)."""
    num_threads: int | None = None
    """torch intra-op threads of the engine thread; None: one per engine CPU (every CPU the process may run on, without engine_cpus)."""
    engine_cpus: str | None = None
    """CPUs (Linux list, e.g. 0-13) for the engine thread and its OpenMP team alone; the worker's
    other threads move to the CPUs it may use that are left. None: everything shares every CPU."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to."""
    metrics_port: int = 0
    """Port of the Prometheus endpoint; 0 picks a free one."""
    engine_thread_nice: int = 5
    """Nice increment of the engine thread and of the OpenMP threads it starts. On a CPU the
    engine's OpenMP team spins on every core; at the same priority, each wake-up of the
    serving path (Ray's threads, the event loop) waited for a slice. With the GIL interval
    below it took the serving path's share of TTFT at 8 streams from 14.5 to 10.1 ms (p50,
    bench/README.md). The engine keeps the CPU whenever nothing else runs."""
    gil_switch_interval_s: float = 0.0005
    """``sys.setswitchinterval`` of the worker process. The engine thread holds the GIL between
    torch ops; with Python's default (5 ms), a Ray callback or the event loop could wait that
    long for it on every hop while the engine runs."""

    tp_rank_cpus: float = 1.0
    """Logical CPUs each follower rank of a tensor-parallel replica reserves (its placement
    group bundle); a fraction lets TP 3 run on a 2-core machine. The leader reserves the
    replica's own CPUs."""

    @property
    def engine_cpu_set(self) -> frozenset[int] | None:
        """``engine_cpus`` as a set of CPU numbers; None when unset."""
        return parse_cpu_list(self.engine_cpus) if self.engine_cpus is not None else None

    def __post_init__(self) -> None:
        if not 0 <= self.engine_thread_nice <= 19:
            raise ValueError(f"engine_thread_nice: must be in [0, 19], got {self.engine_thread_nice}")
        if not 0 < self.gil_switch_interval_s <= 0.1:
            raise ValueError(f"gil_switch_interval_s: must be in (0, 0.1], got {self.gil_switch_interval_s}")
        if not self.tp_rank_cpus > 0:
            raise ValueError(f"tp_rank_cpus: must be > 0, got {self.tp_rank_cpus}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: must be >= 0, got {self.max_waiting_requests}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if self.engine_cpus is not None:
            try:
                parse_cpu_list(self.engine_cpus)
            except ValueError as e:
                raise ValueError(f"engine_cpus: {e}") from None
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is not a port")
