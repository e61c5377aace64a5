"""Logits processing and log-probabilities through the engine (tiny random Llama): what the
sampler is given equals the reference processing of the model's own logits, logit bias forces and
bans, min_tokens holds EOS and stop tokens back, reported log-probabilities are the log-softmax of
the very logits sampled from, prompt log-probabilities equal a teacher-forced forward pass, and
the disaggregated first token carries its own."""

import pytest
import torch

import engine.logits
import engine.runner
from engine.params import SamplingParams
from engine.request import FinishReason
from engine.step_plan import PlannedChunk, StepPlan
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered
from tests.unit.engine.test_logits import _reference
from tests.unit.engine.test_remote_prefill import _ship

SEEDED = dict(temperature=0.8, seed=5, ignore_eos=True)


def _captured(monkeypatch) -> list[tuple[torch.Tensor, list[int]]]:
    """Record every batch of logits the runner's sampler is given, and the tokens it drew."""
    real, seen = engine.runner.sample, []

    def sample(logits, params, seeds, positions):
        tokens = real(logits, params, seeds, positions)
        seen.append((logits.clone(), tokens))
        return tokens

    monkeypatch.setattr(engine.runner, "sample", sample)
    return seen


def _teacher_forced(model_dir, sequence: list[int]) -> torch.Tensor:
    """``float32 [len(sequence), vocab]``: the model's logits at every position, one forward pass."""
    fresh = make_engine(model_dir, max_num_batched_tokens=256)
    chunk = PlannedChunk(0, len(sequence), tuple(sequence), tuple(range(-(-len(sequence) // fresh.config.block_size))))
    return fresh.runner.run(StepPlan(decodes=(), prefills=(chunk,), sample_rows=tuple(range(len(sequence)))))


def _run(engine, prompt, params, request_id="r", **kwargs):
    engine.add_request(request_id, prompt, params, **kwargs)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_the_sampler_gets_the_models_logits_after_every_penalty(tiny_llama_dir, monkeypatch):
    """A resumed request (its earlier output given back) has output tokens on its first step:
    that step's logits are the teacher-forced ones after bias, repetition over prompt and output,
    presence and frequency over the output."""
    prompt, resumed = random_prompts([20], seed=1)[0], [7, 300, 7]
    params = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias=((9, 3.0), (11, -2.0)), repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7
    )
    seen = _captured(monkeypatch)
    _run(make_engine(tiny_llama_dir), prompt, params, resume_token_ids=resumed)
    raw = _teacher_forced(tiny_llama_dir, prompt + resumed)[-1]
    row = engine.logits.SampleRow(params, 0, len(resumed), prompt, tuple(resumed), frozenset())
    torch.testing.assert_close(seen[0][0][0], _reference(raw, row), rtol=0, atol=1e-4)
    assert not torch.allclose(seen[0][0][0], raw, atol=1e-2)


def test_logit_bias_forces_a_token_and_bans_others(tiny_llama_dir):
    llm = make_engine(tiny_llama_dir)
    forced = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logit_bias=((42, 100.0),), **SEEDED))[0]
    assert forced.output_token_ids == (42,) * 8
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], greedy)[0].output_token_ids
    banned = tuple((t, -100.0) for t in set(plain))
    again = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=banned))[0]
    assert not set(again.output_token_ids) & set(plain)


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_then(tiny_llama_dir):
    llm = make_engine(tiny_llama_dir)
    eos = sorted(llm.eos_token_ids)
    to_eos = tuple((t, 100.0) for t in eos)
    ends = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, min_tokens=3, temperature=0, logit_bias=to_eos))[0]
    assert len(ends.output_token_ids) == 4 and ends.output_token_ids[3] in eos and ends.finish_reason is FinishReason.STOP
    assert not set(ends.output_token_ids[:3]) & set(eos)
    to_stop = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(42,), logit_bias=((42, 100.0),), **SEEDED)
    stops = llm.generate([[5, 6, 7]], to_stop)[0]
    assert len(stops.output_token_ids) == 3 and stops.output_token_ids[2] == 42 and 42 not in stops.output_token_ids[:2]
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, logit_bias=to_eos))[0].output_token_ids[0] in eos


def test_logprobs_are_the_log_softmax_of_the_logits_sampled_from(tiny_llama_dir, monkeypatch):
    params = SamplingParams(max_tokens=6, logprobs=5, presence_penalty=1.0, logit_bias=((3, 1.5),), **SEEDED)
    seen = _captured(monkeypatch)
    outputs = _run(make_engine(tiny_llama_dir), random_prompts([12], seed=2)[0], params)
    logprobs = [lp for out in outputs for lp in out.logprobs]
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert len(logprobs) == len(tokens) == len(seen) == 6
    for (logits, drawn), token, got in zip(seen, tokens, logprobs):
        reference = torch.log_softmax(logits[0] / torch.tensor([0.8])[:, None], dim=-1)[0]
        assert drawn == [token] and got.token_id == token and got.logprob == reference[token].item()
        assert [t for t, _ in got.top] == reference.topk(5).indices.tolist()
        assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True)
        assert all(lp == got.logprob for t, lp in got.top if t == token)


def test_greedy_logprobs_are_read_at_temperature_one_and_the_token_is_the_top(tiny_llama_dir, monkeypatch):
    seen = _captured(monkeypatch)
    outputs = _run(make_engine(tiny_llama_dir), [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    for (logits, _), got in zip(seen, [lp for out in outputs for lp in out.logprobs]):
        assert got.top[0] == (got.token_id, got.logprob)
        assert got.logprob == torch.log_softmax(logits, dim=-1)[0, got.token_id].item()
    assert all(out.prompt_logprobs == () for out in outputs)


def test_requests_without_logprobs_report_none_beside_ones_that_ask(tiny_llama_dir):
    prompts = random_prompts([5, 17, 40], seed=4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = run_staggered(make_engine(tiny_llama_dir), prompts, greedy)
    llm = make_engine(tiny_llama_dir)
    asking = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    outputs = []
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, asking if i == 1 else greedy)
    while llm.has_unfinished_requests():
        outputs += llm.step()
    for i in range(3):
        mine = [o for o in outputs if o.request_id == f"r{i}"]
        assert tuple(t for o in mine for t in o.new_token_ids) == expected[i]  # logprobs change no token
        assert all(len(o.logprobs) == (len(o.new_token_ids) if i == 1 else 0) for o in mine)


def test_prompt_logprobs_equal_a_teacher_forced_pass_across_chunks_and_skip_the_prefix_cache(tiny_llama_dir):
    prompt = random_prompts([70], seed=6)[0]
    llm = make_engine(tiny_llama_dir)  # 32-token steps: the prompt takes three
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outputs = _run(llm, prompt, params, "a")
    first = outputs[0].prompt_logprobs
    assert [lp.token_id for lp in first] == prompt[1:]
    assert all(out.prompt_logprobs == () for out in outputs[1:])
    reference = torch.log_softmax(_teacher_forced(tiny_llama_dir, prompt), dim=-1)
    for position, got in enumerate(first):
        assert got.logprob == pytest.approx(reference[position, prompt[position + 1]].item(), abs=1e-4)
        assert [t for t, _ in got.top] == reference[position].topk(3).indices.tolist()
    again = _run(llm, prompt, params, "b")
    assert again[0].num_cached_tokens == 0 and [lp.token_id for lp in again[0].prompt_logprobs] == prompt[1:]
    assert [lp.logprob for lp in again[0].prompt_logprobs] == pytest.approx([lp.logprob for lp in first], abs=1e-5)
    assert _run(llm, prompt, SamplingParams(max_tokens=1, temperature=0), "c")[0].num_cached_tokens == 64


def test_prompt_logprobs_come_once_after_preemptions(tiny_llama_dir):
    prompts = random_prompts([40, 45, 50, 33], seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    small = make_engine(tiny_llama_dir, num_kv_blocks=12, max_num_batched_tokens=64)
    outputs = []
    for i, prompt in enumerate(prompts):
        small.add_request(f"r{i}", prompt, params)
    while small.has_unfinished_requests():
        outputs += small.step()
    assert small.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        reported = [o.prompt_logprobs for o in outputs if o.request_id == f"r{i}" and o.prompt_logprobs]
        assert len(reported) == 1 and [lp.token_id for lp in reported[0]] == prompt[1:]


def test_the_disaggregated_first_token_carries_its_logprobs(tiny_llama_dir):
    prompt = random_prompts([33], seed=8)[0]
    params = SamplingParams(max_tokens=4, logprobs=3, repetition_penalty=1.2, **SEEDED)
    aggregated = _run(make_engine(tiny_llama_dir), prompt, params)
    prefill, decode = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    slot = decode.add_remote_request("r", prompt, params)
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, logprobs=3, repetition_penalty=1.2, **SEEDED), hold_kv=True)
    [prefilled] = [out for out in (prefill.step() + prefill.step()) if out.finished]
    done = prefill.take_prefilled("r")
    _ship(prefill, decode, slot, done)
    first = decode.join_remote("r", done.first_token, prefilled.logprobs[0])
    assert first.new_token_ids == aggregated[0].new_token_ids and first.logprobs == prefilled.logprobs
    assert first.logprobs[0].logprob == pytest.approx(aggregated[0].logprobs[0].logprob, abs=1e-5)
    decode.release_lease("r")
    rest = []
    while decode.has_unfinished_requests():
        rest += decode.step()
    assert [lp.token_id for out in rest for lp in out.logprobs] == [t for out in aggregated[1:] for t in out.new_token_ids]


def test_a_request_asking_for_prompt_logprobs_is_prefilled_where_it_decodes(tiny_llama_dir):
    decode = make_engine(tiny_llama_dir)
    assert decode.add_remote_request("r", random_prompts([40], seed=9)[0], SamplingParams(prompt_logprobs=0)) is None
    assert len(decode.scheduler.waiting) == 1


def test_a_logit_bias_outside_the_vocabulary_is_refused_by_name(tiny_llama_dir):
    from engine.errors import InvalidRequestError

    llm = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.add_request("r", [5, 6], SamplingParams(logit_bias=((llm.model_config.vocab_size, 1.0),)))


def test_graphed_decode_steps_run_eagerly_for_rows_that_process_logits_or_want_logprobs(tiny_llama_dir):
    from tests.unit.engine.test_device_path import _triton_engine

    graphed = _triton_engine(tiny_llama_dir, graphs=True, graph_max_batch=4)
    assert not graphed.runner.graphs.covers(2, 0, 2, plain=False) and graphed.runner.graphs.covers(2, 0, 2)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, repetition_penalty=1.5)
    on_cpu = [lp for o in _run(make_engine(tiny_llama_dir), [5, 6, 7], greedy) for lp in o.logprobs]
    for params in (greedy, SamplingParams(max_tokens=4, presence_penalty=1.0, **SEEDED)):
        before = graphed.runner.num_graph_steps
        outputs = _run(graphed, [5, 6, 7], params)
        assert graphed.runner.num_graph_steps == before and sum(len(o.new_token_ids) for o in outputs) == 4
        if params is greedy:  # the device path processes the same logits the same way
            got = [lp for o in outputs for lp in o.logprobs]
            assert [lp.token_id for lp in got] == [lp.token_id for lp in on_cpu]
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in on_cpu], abs=1e-4)
    _run(graphed, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "plain")
    assert graphed.runner.num_graph_steps > 0


def test_verify_rows_count_the_drafts_before_them_as_output(tiny_llama_dir):
    """Speculative decoding changes no token or log-probability under penalties: row j of a
    verify chunk is penalized as if drafts 0..j-1 were already output (the model drafting for
    itself without penalties, greedy: drafts are accepted where the penalties keep its argmax)."""
    prompts = random_prompts((5, 16, 33), seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1, presence_penalty=0.02, frequency_penalty=0.01, repetition_penalty=1.01)
    plain = make_engine(tiny_llama_dir)
    speculating = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_llama_dir), spec_token_cost=0.0, spec_chunk_cost=0.0)
    for i, prompt in enumerate(prompts):
        want, got = _run(plain, prompt, params, f"p{i}"), _run(speculating, prompt, params, f"s{i}")
        assert [t for o in got for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
        for a, b in zip([lp for o in got for lp in o.logprobs], [lp for o in want for lp in o.logprobs]):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    stats = speculating.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
