"""The engine's GPU path run here: layers write their K/V into the pool before attending and
decode attention reads the pool through the Triton kernel (Triton's interpreter on CPU, which
tests/conftest.py switches on). tests/gpu/test_engine_cuda.py runs the same engine on CUDA.

Also the device settings' bad input: each refused by name.
"""

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from kv_store.fp8 import dequantize_fp8
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered

PROMPTS = random_prompts(lengths=(1, 17, 40))
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU pool in Triton's interpreter; tests/gpu/test_engine_cuda.py runs this path on the GPU")
FEW = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _triton_engine(model_dir, graphs: bool = False, **overrides) -> LLMEngine:
    """The device path on a CPU pool: eager steps, or (``graphs``) decode steps from the graphs'
    static buffers with the capture skipped, as a CUDA engine runs them without ``enforce_eager``."""
    engine = make_engine(model_dir, **overrides)
    engine.kv_cache.triton_decode = True
    if graphs:
        engine.runner.use_graphs(engine.config.graph_max_batch or engine.config.max_num_seqs, engine.max_model_len, capture=False)
    return engine


@pytest.fixture(scope="module")
def eager_device_run(tiny_llama_dir) -> tuple[LLMEngine, list[tuple[int, ...]]]:
    """An eager device-path engine after PROMPTS, one joining every step (decode batches up to
    3), and their greedy tokens: the reference of the default path's and the graphs' tests."""
    engine = _triton_engine(tiny_llama_dir)
    return engine, run_staggered(engine, PROMPTS, FEW, every=1)


@on_cpu_only
def test_the_triton_path_decodes_the_tokens_of_the_default_path(tiny_llama_dir, eager_device_run):
    """fp32 KV: the pool holds exactly what the C/torch path patches in, so every token agrees;
    the prompts are prefilled in 32-token chunks, so a later chunk reads earlier ones back."""
    engine, tokens = eager_device_run
    assert tokens == run_staggered(make_engine(tiny_llama_dir), PROMPTS, FEW, every=1)
    assert engine.pool.num_free_blocks == engine.kv_cache.num_blocks  # every block back


SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)


@on_cpu_only
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_graphed_decode_steps_give_the_eager_device_paths_tokens(tiny_llama_dir, kv_dtype):
    """Staggered requests make decode batches of 1 to 3 (padded to buckets 1, 2 and 4), next to
    prefill steps that stay eager; greedy and seeded sampled requests alternate, so the batches
    mix both. The device sampler runs in both engines, so the sampled tokens agree too."""
    prompts = PROMPTS + random_prompts(lengths=(5,), seed=3)
    params = [FEW, SAMPLED, FEW, SAMPLED]
    eager = _triton_engine(tiny_llama_dir, kv_dtype=kv_dtype)
    graphed = _triton_engine(tiny_llama_dir, graphs=True, kv_dtype=kv_dtype, graph_max_batch=8)
    assert graphed.runner.graphs.buckets == (1, 2, 4, 8)
    assert run_staggered(graphed, prompts, params, every=3) == run_staggered(eager, prompts, params, every=3)
    assert graphed.runner.num_graph_steps > 0
    assert eager.runner.graphs is None and eager.runner.num_graph_steps == 0
    assert graphed.pool.num_free_blocks == graphed.kv_cache.num_blocks


@on_cpu_only
def test_seeded_requests_draw_the_same_tokens_in_any_batch_on_the_graphed_path(tiny_llama_dir):
    engine = _triton_engine(tiny_llama_dir, graphs=True)
    alone = run_staggered(engine, PROMPTS[1:2], SAMPLED)
    together = run_staggered(engine, PROMPTS, SAMPLED, every=1)
    assert together[1] == alone[0]
    assert len(set(together)) > 1  # other prompts, other tokens: the draws are not all alike


@on_cpu_only
def test_a_batch_above_the_largest_bucket_runs_eagerly_and_says_so_once(tiny_llama_dir, eager_device_run, caplog):
    _, eager_tokens = eager_device_run
    graphed = _triton_engine(tiny_llama_dir, graphs=True, graph_max_batch=2)
    with caplog.at_level("WARNING", logger="engine.graphs"):
        assert run_staggered(graphed, PROMPTS, FEW, every=1) == eager_tokens
    warnings = [r.getMessage() for r in caplog.records if r.name == "engine.graphs"]
    assert warnings == ["a decode batch of 3 exceeds the largest graph bucket (2): such steps run eagerly"]
    assert graphed.runner.num_graph_steps > 0  # the batches of 1 and 2 near the end still replay


@on_cpu_only
def test_the_graphs_pad_rows_without_writing_their_kv(tiny_llama_dir):
    """A decode step of one sequence run in bucket 1 and padded into bucket 4 (three rows of
    padding, which read and write no KV): the same token, the same pool up to the last
    bits that a 4-row matmul sums in another order than a 1-row one, and no block but the
    sequence's own touched."""
    from engine.graphs import DecodeGraphs

    engines = [_triton_engine(tiny_llama_dir, kv_dtype="fp8_e4m3") for _ in range(2)]
    tokens = []
    for engine, bucket in zip(engines, (1, 4)):
        engine.add_request("r", PROMPTS[1], FEW)
        engine.step()  # the 17-token prompt's prefill, eager: its first output token is at position 17, in its second block
        graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, 4, 8)
        graphs.bucket = lambda n, b=bucket: b
        request = engine._requests["r"]
        decode = (request.token_ids[-1], request.num_tokens - 1, tuple(request.block_ids))
        tokens.append(graphs.run([decode], [request.params], [request.seed], [0]).tolist())
    assert tokens[0] == tokens[1]
    fresh = _triton_engine(tiny_llama_dir, kv_dtype="fp8_e4m3").kv_cache.buffer
    touched = (engines[1].kv_cache.buffer != fresh).any(dim=1).nonzero().flatten().tolist()
    assert touched == sorted(engines[1]._requests["r"].block_ids)
    one, padded = (e.kv_cache for e in engines)
    payload = slice(0, one.layout.payload_bytes)
    assert int((one.buffer[:, payload] != padded.buffer[:, payload]).sum()) <= one.buffer[:, payload].numel() // 1000
    torch.testing.assert_close(padded.scales, one.scales, rtol=1e-5, atol=0)


@on_cpu_only
def test_the_device_paths_fp8_pool_holds_what_the_default_path_writes(tiny_llama_dir):
    """After the same chunked prefills, the FP8 pool that the RoPE+KV kernel wrote layer by layer
    holds the default path's K/V within FP8 rounding. They differ by design: on the device path
    a chunk attends over its own K/V as the pool holds it (quantized, as vLLM's paged kernels
    read it), on the default path over the fresh values, and the fused norm sums its squares in
    another order; each layer's K/V then differ in their last bits, a few codes by a step.
    (tests/unit/engine/test_rope_kv.py checks the write itself byte for byte.)"""
    settings = dict(kv_dtype="fp8_e4m3", max_num_batched_tokens=16)
    engines = [make_engine(tiny_llama_dir, **settings), _triton_engine(tiny_llama_dir, **settings)]
    for engine in engines:
        for i, prompt in enumerate(random_prompts(lengths=(16, 40, 64))):  # one at a time: chunks of 16 from position 0, none of 1 (a decode)
            engine.add_request(f"r{i}", prompt, FIRST)
            while engine.has_unfinished_requests():
                engine.step()
    default, device = (e.kv_cache for e in engines)
    assert default.buffer.any()
    a, b = (dequantize_fp8(c.payload, c.scales) for c in (default, device))
    amax = a.abs().amax(dim=(-2, -1), keepdim=True)
    error = (a - b).abs() / amax.clamp_min(1e-30)  # per (block, head, layer, K/V), relative to its largest value
    assert error.max() <= 0.15  # at most about two e4m3 steps at the top of the range (32 / 448 each)
    assert error.mean() <= 1e-3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(device="tpu"), "device: 'tpu' is not cpu, cuda or cuda:N"),
        (dict(device="cuda", weights="native"), "weights: 'native' with dtype 'float32' does not run on cuda (supported there: dtype float32: weights fp32; dtype bfloat16: weights bf16)"),
        (dict(device="cuda:1", weights="int4"), "does not run on cuda:1"),
        (dict(device="cuda", weights="fp32", speculative="draft", draft_model="smollm2-135m"), "speculative: 'draft' does not run on cuda so far"),
        (dict(device="cuda", weights="fp32", graph_max_batch=0), "graph_max_batch: must be >= 1, got 0"),
    ],
)
def test_device_settings_that_cannot_run_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**overrides)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_at_start_up(tiny_llama_dir):
    with pytest.raises(ValueError, match="device: 'cuda', but torch .* sees no CUDA GPU on this machine"):
        make_engine(tiny_llama_dir, device="cuda", weights="fp32")



def test_a_gpu_index_this_machine_lacks_is_refused_naming_what_exists():
    from engine.build import check_cuda_device

    check_cuda_device("cuda:1", 2)
    with pytest.raises(ValueError, match=r"device: 'cuda:3' was asked for, but this process sees 2 CUDA GPUs \(cuda:0 .. cuda:1\)"):
        check_cuda_device("cuda:3", 2)
    with pytest.raises(ValueError, match="device: 'cuda' was asked for, but this process sees 0 CUDA GPUs"):
        check_cuda_device("cuda", 0)


def test_a_pool_larger_than_the_free_device_memory_is_refused_with_both_sizes():
    from engine.build import check_pool_fits

    check_pool_fits("cuda:0", 1024, 1 << 20, free_bytes=1 << 30, total_bytes=80 << 30)  # exactly fits
    with pytest.raises(ValueError) as e:
        check_pool_fits("cuda:0", 1025, 1 << 20, free_bytes=1 << 30, total_bytes=80 << 30)
    assert str(e.value) == ("kv_cache_bytes: a KV pool of 1025 blocks (1.00 GiB) was asked for on cuda:0, which has 1.00 GiB free "
                            "of 80.00 GiB after the weights; lower kv_cache_bytes or num_kv_blocks")


def test_graph_buckets():
    from engine.graphs import graph_buckets

    assert graph_buckets(1) == (1,)
    assert graph_buckets(3) == (1, 2, 3)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError, match="max_batch: must be >= 1, got 0"):
        graph_buckets(0)


@on_cpu_only
def test_capturing_graphs_needs_a_cuda_pool(tiny_llama_dir):
    engine = _triton_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="capture: CUDA graphs need a CUDA pool, this one is on cpu"):
        engine.runner.use_graphs(4, engine.max_model_len, capture=True)
    with pytest.raises(ValueError, match="use_graphs: decode graphs run on the device path"):
        make_engine(tiny_llama_dir).runner.use_graphs(4, 64, capture=False)


@on_cpu_only
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama-tied", "qwen2-moe"])
def test_every_architecture_decodes_the_default_paths_tokens_on_the_graphed_device_path(tiny_checkpoint, name):
    """Per-head q/k norm (Qwen3), QKV bias (Qwen2), tied embeddings, a sparse MoE with a shared
    expert: the device path's fused kernels around each give the default path's greedy tokens."""
    model_dir = tiny_checkpoint(name)
    prompts = PROMPTS[:2]
    expected = run_staggered(make_engine(model_dir), prompts, FEW)
    engine = _triton_engine(model_dir, graphs=True)
    assert run_staggered(engine, prompts, FEW) == expected
    assert engine.runner.num_graph_steps > 0


@on_cpu_only
def test_ngram_speculation_verifies_its_drafts_on_the_device_path(tiny_llama_dir):
    """Verify chunks (1 + k tokens, k + 1 sampled rows) run eagerly through the paged prefill
    kernel; the tokens are the plain greedy ones."""
    prompt = [[7, 8, 9, 10, 11] * 8]
    expected = run_staggered(make_engine(tiny_llama_dir), prompt, FEW)
    engine = _triton_engine(tiny_llama_dir, graphs=True, speculative="ngram")
    assert run_staggered(engine, prompt, FEW) == expected
