"""Disaggregated prefill at the engine level: one engine prefills with ``hold_kv``, another parks
the request, receives the blocks and decodes. The copy between the two pools stands in for the
wire (the NIXL transport is tested on its own); what is checked here is the engines' side of the
protocol: which blocks, the first token, leases and failure paths."""

import pytest

from engine.params import SamplingParams
from tests.unit.engine.helpers import GREEDY, PROMPT_LENGTHS, make_engine, random_prompts

PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _prefill(prefill, request_id, prompt, params=PREFILL_ONLY):
    prefill.add_request(request_id, prompt, params, hold_kv=True)
    [out] = prefill.run_to_completion([request_id])
    assert len(out.output_token_ids) == 1
    return prefill.take_prefilled(request_id)


def _ship(prefill, decode, slot, done):
    """Copy the blocks the decode side lacks, as a WRITE would, then end both leases."""
    src = list(done.block_ids[slot.first_block :])
    assert len(src) == len(slot.block_ids)
    decode.kv_cache.buffer[list(slot.block_ids)] = prefill.kv_cache.buffer[src]
    prefill.release_lease(done.request_id)


def _disaggregated(prefill, decode, prompts, params=GREEDY):
    """Every prompt prefilled remotely, joined into the decode batch as it arrives."""
    ids = [f"d{i}" for i in range(len(prompts))]
    tokens = {rid: [] for rid in ids}
    for rid, prompt in zip(ids, prompts):
        slot = decode.add_remote_request(rid, prompt, params)
        assert slot is not None
        done = _prefill(prefill, rid, prompt, SamplingParams(max_tokens=1, temperature=params.temperature, seed=params.seed, ignore_eos=True))
        _ship(prefill, decode, slot, done)
        first = decode.join_remote(rid, done.first_token)
        assert decode.release_lease(rid)
        tokens[rid] += first.new_token_ids
        for out in decode.step():  # the next request arrives while these decode
            tokens[out.request_id] += out.new_token_ids
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    return [tuple(tokens[rid]) for rid in ids]


def _aggregated(engine, prompts, params=GREEDY):
    return [c.output_token_ids for c in engine.generate(prompts, params)]


def _assert_pools_empty(*engines):
    for engine in engines:
        stats = engine.stats()
        assert (stats.num_free_kv_blocks, stats.num_leases, stats.num_parked) == (stats.num_kv_blocks, 0, 0)


def test_disaggregated_tokens_equal_aggregated_fp32(tiny_llama_dir):
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    assert _disaggregated(prefill, decode, prompts) == _aggregated(make_engine(tiny_llama_dir), prompts)
    _assert_pools_empty(prefill, decode)


def test_seeded_sampling_continues_the_prefill_generator(tiny_llama_dir):
    prompts = random_prompts([9, 30], seed=12)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=1234, ignore_eos=True)
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    assert _disaggregated(prefill, decode, prompts, params) == _aggregated(make_engine(tiny_llama_dir), prompts, params)


def test_only_blocks_the_decode_side_lacks_are_requested(tiny_llama_dir):
    [shared, tail] = random_prompts([48, 20], seed=13)
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    [first] = _disaggregated(prefill, decode, [shared + tail[:1]])  # 49 tokens: 3 full blocks cached after
    slot = decode.add_remote_request("b", shared + tail, GREEDY)  # 68 tokens = 5 blocks, 3 cached here
    assert (slot.first_block, len(slot.block_ids), slot.num_cached_tokens) == (3, 2, 48)
    done = _prefill(prefill, "b", shared + tail)
    assert done.num_cached_tokens == 48  # the prefill worker reused its own cache too
    _ship(prefill, decode, slot, done)
    out = decode.join_remote("b", done.first_token)
    decode.release_lease("b")
    rest = [t for o in _drain(decode) for t in o.new_token_ids]
    [expected] = _aggregated(make_engine(tiny_llama_dir), [shared + tail])
    assert tuple(out.new_token_ids) + tuple(rest) == expected
    assert first  # the first request produced tokens
    _assert_pools_empty(prefill, decode)


def test_short_uncached_part_is_prefilled_locally(tiny_llama_dir):
    [prompt] = random_prompts([40], seed=14)
    decode = make_engine(tiny_llama_dir)
    assert decode.add_remote_request("a", prompt, GREEDY, max_local_prefill_tokens=40) is None
    [out] = decode.run_to_completion(["a"])
    [expected] = _aggregated(make_engine(tiny_llama_dir), [prompt])
    assert out.output_token_ids == expected
    _assert_pools_empty(decode)


@pytest.mark.parametrize("recompute", [True, False])
def test_failed_transfer_recomputes_or_drops_and_the_lease_pins_the_blocks(tiny_llama_dir, recompute):
    [prompt] = random_prompts([50], seed=15)
    decode = make_engine(tiny_llama_dir, num_kv_blocks=10)
    slot = decode.add_remote_request("a", prompt, GREEDY)
    assert decode.unpark_remote("a", recompute=recompute)
    # the transfer may still land in the slot's blocks: they must not be handed out meanwhile
    stats = decode.stats()
    assert stats.num_free_kv_blocks == 10 - len(slot.block_ids)
    if recompute:
        [out] = decode.run_to_completion(["a"])
        assert out.output_token_ids == _aggregated(make_engine(tiny_llama_dir), [prompt])[0]
        assert not set(slot.block_ids) & set(_blocks_used_while_running(decode, prompt))
    else:
        assert not decode.has_unfinished_requests()
        assert decode.stats().num_aborted_requests == 1
    assert decode.release_lease("a") and not decode.release_lease("a")
    _assert_pools_empty(decode)


def test_abort_while_parked_keeps_the_lease_until_released(tiny_llama_dir):
    [prompt] = random_prompts([40], seed=16)
    decode = make_engine(tiny_llama_dir)
    slot = decode.add_remote_request("a", prompt, GREEDY)
    assert decode.abort_request("a")
    assert decode.join_remote("a", 5) is None  # a late completion finds nothing to join
    assert decode.stats().num_free_kv_blocks == decode.stats().num_kv_blocks - len(slot.block_ids)
    with pytest.raises(Exception, match="already in use"):
        decode.add_request("a", prompt, GREEDY)  # the id is taken while its transfer may run
    decode.release_lease("a")
    _assert_pools_empty(decode)


def test_prefill_side_lease_outlives_the_request(tiny_llama_dir):
    [prompt] = random_prompts([33], seed=17)
    prefill = make_engine(tiny_llama_dir)
    done = _prefill(prefill, "a", prompt)
    assert len(done.block_ids) == 3 and done.num_prompt_tokens == 33
    assert prefill.stats().num_free_kv_blocks == prefill.stats().num_kv_blocks - 3
    assert all(prefill.pool.ref_count(b) == 1 for b in done.block_ids)
    prefill.release_lease("a")
    _assert_pools_empty(prefill)


def test_join_rejects_a_token_outside_the_vocabulary(tiny_llama_dir):
    [prompt] = random_prompts([20], seed=18)
    decode = make_engine(tiny_llama_dir)
    decode.add_remote_request("a", prompt, GREEDY)
    with pytest.raises(Exception, match="first_token"):
        decode.join_remote("a", 10**9)
    decode.unpark_remote("a", recompute=False)
    decode.release_lease("a")
    _assert_pools_empty(decode)


def _drain(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def _blocks_used_while_running(engine, prompt):
    engine.add_request("probe", prompt, GREEDY)
    engine.step()
    [request] = [r for r in engine.scheduler.running if r.request_id == "probe"]
    used = list(request.block_ids)
    engine.abort_request("probe")
    return used
