"""Every finish reason: max_tokens, context length, EOS, stop token ids, stop strings, abort."""

from engine.params import SamplingParams
from engine.request import FinishReason
from engine.stop import StopStringMatcher
from tests.unit.engine.helpers import make_engine, random_prompts

PROMPT = random_prompts([12], seed=11)[0]


def _one(engine, params, prompt=PROMPT):
    engine.add_request("x", prompt, params)
    [out] = engine.run_to_completion(["x"])
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    return out


def _reference(engine, n=20):
    return _one(engine, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def test_max_tokens_ends_with_length(tiny_llama_dir):
    out = _reference(make_engine(tiny_llama_dir), n=5)
    assert (len(out.output_token_ids), out.finish_reason) == (5, FinishReason.LENGTH)


def test_context_length_ends_with_length(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_model_len=20)
    out = _one(engine, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert (len(out.output_token_ids), out.finish_reason) == (20 - len(PROMPT), FinishReason.LENGTH)


def test_stop_token_id_and_eos(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ref = _reference(engine)
    token = ref.output_token_ids[5]
    first = ref.output_token_ids.index(token)  # generation stops at the token's first appearance
    out = _one(engine, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[token]))
    assert out.output_token_ids == ref.output_token_ids[: first + 1]
    assert out.finish_reason == FinishReason.STOP

    engine.eos_token_ids = frozenset({token})  # the model's EOS, as the tokenizer config would set it
    engine.add_request("eos", PROMPT, SamplingParams(max_tokens=20, temperature=0))
    [eos] = engine.run_to_completion(["eos"])
    assert eos.output_token_ids == ref.output_token_ids[: first + 1]
    assert eos.finish_reason == FinishReason.STOP


def test_stop_string_is_cut_from_the_text(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ref = _reference(engine)
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = _one(engine, SamplingParams(max_tokens=20, temperature=0, stop=[stop]))
    assert out.finish_reason == FinishReason.STOP
    assert out.text == text[: text.index(stop)]
    assert len(out.output_token_ids) < len(ref.output_token_ids)


def test_abort_frees_blocks_and_forgets_the_request(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("x", PROMPT * 4, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().num_free_kv_blocks < engine.stats().num_kv_blocks
    assert engine.abort_request("x")
    assert not engine.abort_request("x")
    stats = engine.stats()
    assert (stats.num_free_kv_blocks, stats.num_running, stats.num_waiting) == (stats.num_kv_blocks, 0, 0)
    assert stats.num_aborted_requests == 1
    assert engine.step() == []


def test_partial_stop_string_is_held_back_until_decided():
    m = StopStringMatcher(("STOP",))
    assert m.add("hello S") == ("hello ", None)
    assert m.add("T") == ("", None)
    assert m.add("x") == ("STx", None)
    assert m.add(" and ST") == (" and ", None)
    assert m.add("OP and more") == ("", "STOP")
    assert m.text == "hello STx and "


def test_stop_string_spanning_deltas_and_earliest_match_wins():
    m = StopStringMatcher(("cd", "bc"))
    assert m.add("ab") == ("a", None)
    assert m.add("cd") == ("", "bc")
    assert m.text == "a"
