"""Resuming a request from the output another replica already streamed (``resume_token_ids``):
the continuation is exactly the undisturbed run's rest, tokens and text, greedy or seeded."""

import pytest

from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine, random_prompts

NUM_TOKENS = 20


def _stream(engine, request_id, prompt, params, **kwargs):
    """(token ids, text delta) per output, and the last output."""
    engine.add_request(request_id, prompt, params, **kwargs)
    steps, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps.append((out.new_token_ids, out.text_delta))
            last = out
    return steps, last


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_streamed", [1, 7, NUM_TOKENS - 1])
def test_a_resumed_request_continues_the_undisturbed_stream(engine, params, num_streamed):
    [prompt] = random_prompts([37], seed=3)
    whole, whole_last = _stream(engine, "whole", prompt, params)
    tokens = [t for ids, _ in whole for t in ids]
    assert len(tokens) == NUM_TOKENS
    streamed_text = "".join(text for _, text in whole[:num_streamed])
    rest, last = _stream(engine, "resumed", prompt, params, resume_token_ids=tokens[:num_streamed])
    assert [t for ids, _ in rest for t in ids] == tokens[num_streamed:]
    assert streamed_text + "".join(text for _, text in rest) == "".join(text for _, text in whole)
    assert (last.num_prompt_tokens, last.num_output_tokens, last.finish_reason) == (len(prompt), NUM_TOKENS, whole_last.finish_reason)
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_stop_string_spanning_the_resume_point_still_stops_and_is_cut(engine):
    [prompt] = random_prompts([12], seed=4)
    free = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    whole, _ = _stream(engine, "free", prompt, free)
    text = "".join(t for _, t in whole)
    cut = len("".join(t for _, t in whole[:10]))
    stop = text[cut - 2 : cut + 3]  # two characters streamed before the resume point, three after
    assert len(stop) == 5 and text.find(stop) == cut - 2, "the tiny model's text repeats; pick another prompt"
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, stop=(stop,))
    stopped, stopped_last = _stream(engine, "stopped", prompt, params)
    streamed = [(ids, t) for ids, t in stopped][:9]
    resumed, last = _stream(engine, "resumed-stop", prompt, params, resume_token_ids=[t for ids, _ in streamed for t in ids])
    assert "".join(t for _, t in streamed + resumed) == "".join(t for _, t in stopped) == text[: cut - 2]
    assert (last.finish_reason, last.stop_reason) == (stopped_last.finish_reason, stop)


def test_resumed_tokens_count_toward_max_tokens(engine):
    [prompt] = random_prompts([5], seed=5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    whole, _ = _stream(engine, "short", prompt, params)
    tokens = [t for ids, _ in whole for t in ids]
    rest, last = _stream(engine, "short-resumed", prompt, params, resume_token_ids=tokens[:4])
    assert [t for ids, _ in rest for t in ids] == tokens[4:]
    assert last.num_output_tokens == 6


@pytest.mark.parametrize("resume, message", [
    ([1, 2, 3, 4, 5, 6], "output token 5 (6) would have finished the request (length)"),
    ([1, 10**9], "token id 1000000000 is outside the vocabulary"),
])
def test_a_resume_the_request_could_not_have_streamed_is_refused(engine, resume, message):
    [prompt] = random_prompts([5], seed=6)
    with pytest.raises(InvalidRequestError, match="resume_token_ids") as e:
        engine.add_request("bad-resume", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), resume_token_ids=resume)
    assert message in str(e.value)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks) == (0, 0, stats.num_kv_blocks)
