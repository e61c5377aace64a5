"""A request whose prefix is cached computes only its uncached tokens, with identical output."""

from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts


def _run(engine, request_id, prompt):
    engine.add_request(request_id, prompt, GREEDY)
    before = engine.stats().num_computed_prompt_tokens
    [out] = engine.run_to_completion([request_id])
    return out, engine.stats().num_computed_prompt_tokens - before


def test_shared_prefix_is_reused_block_for_block(tiny_llama_dir):
    [shared, tail_a, tail_b] = random_prompts([40, 7, 10], seed=3)
    prompt_a, prompt_b = shared + tail_a, shared + tail_b  # 47 and 50 tokens, 2 full shared blocks
    engine = make_engine(tiny_llama_dir)
    out_a, computed_a = _run(engine, "a", prompt_a)
    out_b, computed_b = _run(engine, "b", prompt_b)
    assert (computed_a, out_a.num_cached_tokens) == (47, 0)
    assert (computed_b, out_b.num_cached_tokens) == (50 - 32, 32)

    uncached = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    expected_b, computed = _run(uncached, "b", prompt_b)
    assert computed == 50
    assert out_b.output_token_ids == expected_b.output_token_ids
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_whole_prompt_cached_still_computes_its_last_block(tiny_llama_dir):
    [prompt] = random_prompts([32], seed=4)
    engine = make_engine(tiny_llama_dir)
    first, _ = _run(engine, "a", prompt)
    again, computed = _run(engine, "b", prompt)
    # at least one token must run to produce logits; with 16-token blocks that is the whole last block
    assert (computed, again.num_cached_tokens) == (16, 16)
    assert again.output_token_ids == first.output_token_ids


def test_generated_blocks_are_cached_too(tiny_llama_dir):
    [prompt] = random_prompts([20], seed=5)
    engine = make_engine(tiny_llama_dir)
    first, _ = _run(engine, "a", prompt)  # 20 + 24 tokens: blocks 0 and 1 are full when it ends
    follow_up = prompt + list(first.output_token_ids) + [7, 8, 9]
    out, computed = _run(engine, "b", follow_up)
    assert out.num_cached_tokens == 32
    assert computed == len(follow_up) - 32


def test_tenant_salt_isolates_the_cache(tiny_llama_dir):
    [prompt] = random_prompts([40], seed=6)
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", prompt, GREEDY, tenant_salt="tenant-a")
    engine.run_to_completion(["a"])
    engine.add_request("b", prompt, GREEDY, tenant_salt="tenant-b")
    [b] = engine.run_to_completion(["b"])
    engine.add_request("c", prompt, GREEDY, tenant_salt="tenant-a")
    [c] = engine.run_to_completion(["c"])
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 32)
    assert b.output_token_ids == c.output_token_ids
