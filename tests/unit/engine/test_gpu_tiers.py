"""The KV tiers of a GPU pool: the code path runs here with FakeStreamCopier standing in for the
CUDA side stream (copies land only when the store waits for them), and on a GPU for real."""

from __future__ import annotations

import pytest
import torch

from kv_store import tiered
from kv_store.block_copier import CudaBlockCopier
from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.events import KVEventLog, Tier
from kv_store.tiered import TieredKVStore
from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts
from tests.unit.kv_store.fake_stream import FakeStreamCopier


@pytest.fixture
def fake_streams(monkeypatch) -> list[FakeStreamCopier]:
    """Every TieredKVStore built from now on copies through a FakeStreamCopier, listed here."""
    made: list[FakeStreamCopier] = []

    def copier(pool: torch.Tensor, slots: torch.Tensor | None = None) -> FakeStreamCopier:
        made.append(FakeStreamCopier(pool, slots))
        return made[-1]

    monkeypatch.setattr(tiered, "block_copier", copier)
    return made


def _run(engine, request_id, prompt):
    engine.add_request(request_id, prompt, GREEDY)
    [out] = engine.run_to_completion([request_id])
    return out


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.REDIS])
def test_an_engine_on_deferred_copies_serves_lower_tier_prefixes_as_recompute(tiny_llama_dir, redis_server, fake_streams, tier):
    [prompt] = random_prompts([70], seed=21)  # 4 full blocks reusable
    if tier is Tier.CPU:
        engine = make_engine(tiny_llama_dir, cpu_kv_cache_bytes=1 << 20)
    else:
        redis_server.client().flushall()
        engine = make_engine(tiny_llama_dir, redis_url=redis_server.url)
    [copier] = fake_streams
    try:
        first = _run(engine, "a", prompt)
        num_offloaded = engine.offload_prefix_cache()
        saves = [entry for entry in copier.log if entry[0] == ("save" if tier is Tier.CPU else "block_bytes")]
        assert len(saves) == num_offloaded > 4
        if tier is Tier.REDIS:
            assert engine.kv_store.redis.flush()
        engine.kv_cache.buffer.fill_(0xFF)  # NaN everywhere: what the step reads of the prefix, the loads wrote
        copier.log.clear()
        again = _run(engine, "b", prompt)
        assert again.num_cached_tokens == 64 and again.output_token_ids == first.output_token_ids
        loads = [entry[0] for entry in copier.log if entry[0] in ("load", "load_bytes")]
        assert loads == ["load" if tier is Tier.CPU else "load_bytes"] * 4
        assert copier.log.index(("fence",)) == 4  # right after the 4 loads, before the step that reads them
        assert copier.num_queued == 0
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_gpu_copier_needs_pinned_slots():
    with pytest.raises(ValueError, match="slots: the CPU tier's buffer must be pinned"):
        CudaBlockCopier(torch.zeros((2, 8), dtype=torch.uint8, device="cuda"), torch.zeros((2, 8), dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("num_slots", [16, 4])
def test_gpu_blocks_round_trip_through_pinned_slots_byte_for_byte(num_slots):
    """1 MiB blocks, so a copy the compute stream did not wait for would lose the race: the pool
    is overwritten on the compute stream right after the evictions, and read right after the
    loads. With 4 slots, slots are reused while their copies may be in flight."""
    num_blocks, block_bytes = 16, 1 << 20
    pool = BlockPool(num_blocks)
    buffer = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, device="cuda")
    expected = buffer.cpu()
    store = TieredKVStore(pool, buffer, KVEventLog("w"), CPUTier(num_slots * block_bytes, block_bytes, pin_memory=True))
    assert isinstance(store.copier, CudaBlockCopier)
    ids = pool.allocate(num_blocks)
    for block_id in ids:
        pool.cache(block_id, 100 + block_id)
    pool.release(reversed(ids))
    assert store.evict_pool() == num_blocks  # blocks 15, 14, ..., 0: the CPU tier keeps the last num_slots
    buffer.fill_(0)
    kept = list(range(num_slots))
    loaded = store.load([100 + b for b in kept])
    assert len(loaded) == num_slots
    assert torch.equal(buffer[loaded].cpu(), expected[kept])
    store.close()


@pytest.mark.gpu
def test_an_engine_on_cuda_serves_a_prefix_from_its_cpu_tier_as_recompute(tiny_llama_dir):
    [prompt] = random_prompts([70], seed=21)
    engine = make_engine(tiny_llama_dir, device="cuda", weights="fp32", cpu_kv_cache_bytes=1 << 20)
    try:
        assert engine.kv_cache.buffer.is_cuda and engine.kv_store.cpu.buffer.is_pinned()
        first = _run(engine, "a", prompt)
        assert engine.offload_prefix_cache() > 4
        again = _run(engine, "b", prompt)
        assert again.num_cached_tokens == 64 and again.output_token_ids == first.output_token_ids
        assert engine.kv_store.stats.tiers[Tier.CPU].num_hits == 4
    finally:
        engine.close()
    uncached = make_engine(tiny_llama_dir, device="cuda", weights="fp32", enable_prefix_caching=False)
    assert uncached.generate([prompt], GREEDY)[0].output_token_ids == first.output_token_ids
