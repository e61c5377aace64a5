"""OpenAI answers from hand-built GenerateResponses: n choices by index, usage summed over the
samples, log-probabilities in each endpoint's shape (token texts and bytes from SmolLM2's
tokenizer), and streamed deltas with tool calls held back and sent whole."""

import json

import pytest

from engine.tokenizer import Tokenizer
from proto import splitserve_pb2 as pb
from router.frontend.apis.openai_choices import ChatChoice, CompletionChoice
from router.frontend.apis.openai_shapes import Sample, collect, summed_usage
from router.frontend.apis.token_texts import TokenStrings
from router.frontend.apis.openai_tools import ToolPlan
from router.frontend.apis.tool_parsers import HermesParser

STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def entry(token_id: int, logprob: float, *top: tuple[int, float]) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=token_id, logprob=logprob, top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def response(index: int, text: str, token_ids=(), logprobs=(), finish=None, usage=None) -> pb.GenerateResponse:
    r = pb.GenerateResponse(index=index, text=text, token_ids=list(token_ids), logprobs=list(logprobs))
    if finish is not None:
        r.finish_reason = finish
        r.usage.CopyFrom(usage)
    return r


def test_n_samples_interleaved_become_choices_in_order_with_usage_summed():
    responses = [
        response(1, "b"), response(0, "a"), response(2, "c"),
        response(0, "a2", finish=STOP, usage=pb.Usage(prompt_tokens=9, completion_tokens=2, cached_prompt_tokens=0)),
        response(2, "", finish=LENGTH, usage=pb.Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=8)),
        response(1, "b2", finish=STOP, usage=pb.Usage(prompt_tokens=9, completion_tokens=3, cached_prompt_tokens=8)),
    ]
    samples = collect(responses, 3)
    strings = TokenStrings(None)
    choices = [CompletionChoice(i, strings, logprobs=False).whole(s) for i, s in enumerate(samples)]
    assert choices == [
        {"index": 0, "text": "aa2", "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "text": "bb2", "logprobs": None, "finish_reason": "stop"},
        {"index": 2, "text": "c", "logprobs": None, "finish_reason": "length"},
    ]
    assert summed_usage(samples) == {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_shape(tokenizer):
    hello, world, comma = tokenizer.encode("Hello world,", add_special_tokens=False)
    sample = Sample(0)
    sample.add(response(0, "Hello", [hello], [entry(hello, -0.5, (hello, -0.5), (comma, -1.5))]))
    sample.add(response(0, " world", [world], [entry(world, -0.25, (world, -0.25))], finish=STOP, usage=pb.Usage()))
    choice = ChatChoice(0, TokenStrings(tokenizer), logprobs=True, plan=None, parser=None).whole(sample)
    assert choice["message"] == {"role": "assistant", "content": "Hello world"}
    assert choice["logprobs"] == {"content": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
            {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}, {"token": ",", "logprob": -1.5, "bytes": [44]}]},
        {"token": " world", "logprob": -0.25, "bytes": list(b" world"), "top_logprobs": [{"token": " world", "logprob": -0.25, "bytes": list(b" world")}]},
    ]}


def test_completion_logprobs_shape_with_offsets_across_streamed_chunks(tokenizer):
    hello, world, comma = tokenizer.encode("Hello world,", add_special_tokens=False)
    first = response(0, "Hello", [hello], [entry(hello, -0.5, (comma, -1.5))])
    last = response(0, " world", [world], [entry(world, -0.25, (world, -0.25))], finish=LENGTH, usage=pb.Usage())
    sample = Sample(0)
    sample.add(first)
    sample.add(last)
    whole = CompletionChoice(0, TokenStrings(tokenizer), logprobs=True).whole(sample)["logprobs"]
    assert whole == {"tokens": ["Hello", " world"], "token_logprobs": [-0.5, -0.25],
                     "top_logprobs": [{",": -1.5, "Hello": -0.5}, {" world": -0.25}], "text_offset": [0, 5]}
    streamed = CompletionChoice(0, TokenStrings(tokenizer), logprobs=True)
    deltas = streamed.feed(first) + streamed.feed(last) + streamed.finish(last)
    assert [d["logprobs"]["text_offset"] if d["logprobs"] else None for d in deltas] == [[0], [5], None]
    assert [d["finish_reason"] for d in deltas] == [None, None, "length"]


def test_a_split_character_keeps_its_bytes(tokenizer):
    ids = tokenizer.encode("日", add_special_tokens=False)
    entries = [entry(i, -0.1) for i in ids]
    sample = Sample(0)
    sample.add(response(0, "日", ids, entries, finish=STOP, usage=pb.Usage()))
    items = ChatChoice(0, TokenStrings(tokenizer), True, None, None).whole(sample)["logprobs"]["content"]
    assert bytes(b for item in items for b in item["bytes"]) == "日".encode()


def test_a_required_tool_call_is_held_and_sent_whole():
    plan = ToolPlan("required")
    choice = ChatChoice(1, TokenStrings(None), logprobs=False, plan=plan, parser=None)
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    pieces = [response(1, text[:10]), response(1, text[10:], finish=STOP, usage=pb.Usage())]
    deltas = choice.feed(pieces[0]) + choice.feed(pieces[1]) + choice.finish(pieces[1])
    [calls, done] = deltas
    [call] = calls["delta"]["tool_calls"]
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    assert (calls["index"], done["delta"], done["finish_reason"]) == (1, {}, "tool_calls")
    sample = Sample(1)
    for piece in pieces:
        sample.add(piece)
    whole = ChatChoice(1, TokenStrings(None), False, plan, None).whole(sample)
    assert whole["message"]["content"] is None and json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert whole["finish_reason"] == "tool_calls"


def test_auto_streams_content_until_a_call_begins():
    choice = ChatChoice(0, TokenStrings(None), logprobs=False, plan=ToolPlan("auto"), parser=HermesParser())
    pieces = ["Let me ", "check. <tool", "_call>{\"name\": \"now\", ", "\"arguments\": {}}</tool_call>"]
    deltas = []
    for piece in pieces[:-1]:
        deltas += choice.feed(response(0, piece))
    last = response(0, pieces[-1], finish=STOP, usage=pb.Usage())
    deltas += choice.feed(last) + choice.finish(last)
    assert [d["delta"].get("content") for d in deltas[:2]] == ["Let me ", "check. "]
    assert [c["function"] for c in deltas[2]["delta"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    assert deltas[3]["finish_reason"] == "tool_calls" and len(deltas) == 4


def test_auto_sends_held_text_that_was_not_a_call():
    choice = ChatChoice(0, TokenStrings(None), logprobs=False, plan=ToolPlan("auto"), parser=HermesParser())
    deltas = choice.feed(response(0, "a <tool"))
    last = response(0, "box", finish=LENGTH, usage=pb.Usage())
    deltas += choice.feed(last) + choice.finish(last)
    assert "".join(d["delta"].get("content", "") for d in deltas) == "a <toolbox"
    assert deltas[-1]["finish_reason"] == "length"

