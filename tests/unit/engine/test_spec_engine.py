"""Speculative decoding in the engine, on tiny random models: the same tokens as plain decoding,
blocks rolled back, a batch mixing verify chunks with decodes and prefills, preemption, the
draft-model variant, the decode side of disaggregation, and sampling checked statistically.

The engines speculate with ``spec_token_cost=0`` and ``spec_chunk_cost=0`` (free verify steps), so that drafts of a
tiny random model are verified often enough to exercise every path."""

import torch

from engine.params import SamplingParams
from engine.step_plan import PlannedChunk, StepPlan
from engine.spec.policy import SpecPolicy
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered
from tests.unit.engine.test_remote_prefill import _disaggregated

GREEDY_40 = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _repetitive_prompts():
    """Prompts that repeat themselves (n-gram drafts get proposed) mixed with random ones."""
    repeated = [p + p for p in random_prompts((5, 16, 17, 33), seed=3)]
    return repeated + random_prompts((1, 40, 70), seed=4)


def _assert_no_blocks_held(engine):
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def _assert_cache_matches(spec_engine, plain_engine):
    """Every block both prefix caches hold under one key holds the same K/V (up to rounding):
    a published block with a rejected draft's K/V would differ from plain decoding's."""
    common = set(spec_engine.pool.cached_keys()) & set(plain_engine.pool.cached_keys())
    assert len(common) >= 10
    for key in common:
        [a] = spec_engine.pool.match_prefix([key])
        [b] = plain_engine.pool.match_prefix([key])
        got = spec_engine.kv_cache.buffer[a].view(torch.float32)
        want = plain_engine.kv_cache.buffer[b].view(torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_ngram_greedy_equals_plain_decoding_in_a_mixed_batch(tiny_llama_dir):
    plain = make_engine(tiny_llama_dir)
    spec = make_engine(tiny_llama_dir, speculative="ngram", spec_token_cost=0.0, spec_chunk_cost=0.0)
    prompts = _repetitive_prompts()
    want = run_staggered(plain, prompts, GREEDY_40)
    assert run_staggered(spec, prompts, GREEDY_40) == want
    stats = spec.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_steps < plain.stats().num_steps
    _assert_no_blocks_held(spec)
    _assert_cache_matches(spec, plain)


def test_rollback_frees_blocks_of_rejected_drafts_under_preemption(tiny_llama_dir):
    """A pool too small for the batch: verify chunks give way to plain decodes, requests are
    preempted and recomputed, and every block comes back."""
    prompts = [p + p for p in random_prompts((5, 8, 10), seed=3)] + random_prompts((12,), seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = make_engine(tiny_llama_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=64)
    spec = make_engine(tiny_llama_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=64, speculative="ngram", spec_token_cost=0.0, spec_chunk_cost=0.0)
    want = run_staggered(plain, prompts, params, every=1)
    assert run_staggered(spec, prompts, params, every=1) == want
    assert spec.stats().num_preemptions > 0 and spec.stats().num_draft_tokens > 0
    _assert_no_blocks_held(spec)


def test_rollback_shrinks_the_sequence_to_its_accepted_tokens(tiny_llama_dir):
    """Step by step: after each verify step the request holds exactly the blocks of its
    computed tokens, and the pool's free count says the same."""
    engine = make_engine(tiny_llama_dir, speculative="ngram", spec_token_cost=0.0, spec_chunk_cost=0.0, block_size=4)
    [prompt] = random_prompts((6,), seed=3)
    engine.add_request("r", prompt * 3, GREEDY_40)
    request = engine._requests["r"]
    verified = 0
    while engine.has_unfinished_requests():
        drafted_before = engine.stats().num_draft_tokens
        engine.step()
        if request.finished:
            break
        verified += engine.stats().num_draft_tokens > drafted_before
        assert request.num_computed_tokens == request.num_tokens - 1
        assert len(request.block_ids) == -(-request.num_computed_tokens // 4)
        assert engine.pool.num_free_blocks == engine.pool.num_blocks - len(request.block_ids)
    assert verified > 0
    _assert_no_blocks_held(engine)


def test_draft_model_greedy_equals_plain_decoding(tiny_checkpoint, tiny_llama_dir):
    """The draft is another tiny checkpoint of the same vocabulary (a different model, so some
    drafts are rejected); the same checkpoint as its own draft accepts every draft."""
    prompts = random_prompts((5, 40), seed=5)
    want = [c.output_token_ids for c in make_engine(tiny_llama_dir).generate(prompts, GREEDY_40)]
    other = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_checkpoint("qwen2")), spec_token_cost=0.0, spec_chunk_cost=0.0)
    assert [c.output_token_ids for c in other.generate(prompts, GREEDY_40)] == want
    stats = other.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens < stats.num_draft_tokens
    _assert_no_blocks_held(other)
    assert other.speculator.proposer.pool.num_free_blocks == other.speculator.proposer.pool.num_blocks
    itself = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_llama_dir), spec_token_cost=0.0, spec_chunk_cost=0.0)
    assert [c.output_token_ids for c in itself.generate(prompts, GREEDY_40)] == want
    stats = itself.stats()
    assert stats.num_accepted_draft_tokens == stats.num_draft_tokens > 0


def test_decode_side_of_disaggregation_speculates(tiny_llama_dir):
    prompts = [p + p for p in random_prompts((5, 16, 33), seed=3)]
    want = [c.output_token_ids for c in make_engine(tiny_llama_dir).generate(prompts, GREEDY_40)]
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir, speculative="ngram", spec_token_cost=0.0, spec_chunk_cost=0.0)
    assert _disaggregated(prefill, decode, prompts, GREEDY_40) == want
    assert decode.stats().num_accepted_draft_tokens > 0
    _assert_no_blocks_held(decode)


def _probabilities(engine, prompt, params):
    """The target's sampling distribution after ``prompt`` (temperature and top-k applied)."""
    chunk = PlannedChunk(start=0, num_tokens=len(prompt), token_ids=tuple(prompt), block_ids=tuple(range(-(-len(prompt) // 16))))
    logits = engine.runner.run(StepPlan(decodes=(), prefills=(chunk,), sample_rows=(len(prompt) - 1,)))[0] / params.temperature
    top = torch.topk(logits, params.top_k)
    probs = torch.zeros_like(logits)
    probs[top.indices] = torch.softmax(top.values, dim=-1)
    return probs


def test_sampled_tokens_follow_the_target_distribution(tiny_llama_dir):
    """400 seeded requests whose second token is verified against a draft (the model itself,
    greedy): its frequencies match the exact marginal sum_t0 p(t0) p(t1 | t0) within a total
    variation of 0.08, while accepting every draft would put all mass on argmax tokens."""
    params = [SamplingParams(max_tokens=3, temperature=1.5, top_k=4, seed=seed, ignore_eos=True) for seed in range(400)]
    [prompt] = random_prompts((6,), seed=8)
    spec = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_llama_dir), max_num_seqs=400, num_kv_blocks=512, max_num_batched_tokens=4096)
    spec.speculator.policy = SpecPolicy(token_cost=0.0, min_gain=1.0)  # every sequence of the big batch verifies its draft
    completions = spec.generate([prompt] * len(params), params)
    stats = spec.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    first = torch.tensor([c.output_token_ids[0] for c in completions])
    second = torch.tensor([c.output_token_ids[1] for c in completions])
    plain = make_engine(tiny_llama_dir, num_kv_blocks=4)
    p0 = _probabilities(plain, prompt, params[0])
    marginal = sum(p0[t] * _probabilities(plain, prompt + [t], params[0]) for t in torch.nonzero(p0).flatten().tolist())
    empirical = torch.bincount(second, minlength=len(marginal)).float() / len(second)
    assert 0.5 * (empirical - marginal).abs().sum() < 0.08
    assert 0.5 * (torch.bincount(first, minlength=len(p0)).float() / len(first) - p0).abs().sum() < 0.08
