"""Structured outputs, log-probabilities, n samples and tool calls through the real ``openai``
SDK and ``tritonclient``, on one cluster serving the bundled SmolLM2 (shared by the module).
Answers are short (24-64 tokens) and schemas small, so the module runs in a few minutes on 2 cores."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from engine.config import EngineConfig
from tests.integration.conftest import running_http_cluster

pytestmark = pytest.mark.integration

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}}]
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(ray_session, smollm2_dir, smollm2_cache_dir):
    engine = EngineConfig(model="smollm2-135m", cache_dir=smollm2_cache_dir, kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=8, max_model_len=1024)
    with running_http_cluster(engine, max_waiting_requests=16) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(http_address):
    return openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    [info] = sdk.models.list().data
    return info.id


def test_json_schema_samples_parse_and_validate(sdk, model):
    # age is bounded: a 135M model may otherwise write digits until max_tokens cuts the JSON short
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2, 3):
        got = sdk.chat.completions.create(model=model, messages=ASK_PERSON, response_format=response_format, seed=seed, temperature=0.8, max_tokens=64)
        [choice] = got.choices
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    got = sdk.chat.completions.create(model=model, messages=ASK_PERSON, response_format=response_format, seed=9, temperature=0.8, max_tokens=64, n=3)
    for choice in got.choices:  # each sample with its own constraint state
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK_PERSON, response_format={"type": "json_object"}, temperature=0, max_tokens=64, stream=True))
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)


def test_structured_outputs_regex_and_choice(sdk, model):
    got = sdk.completions.create(model=model, prompt="My phone number is", max_tokens=24, temperature=0.7, seed=4,
                                 extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", got.choices[0].text), got.choices[0].text
    got = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=24,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert got.choices[0].message.content in ("yes", "no")


def test_logprobs_are_consistent(sdk, model):
    got = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0.9, seed=7,
                                      logprobs=True, top_logprobs=3)
    [choice] = got.choices
    items = choice.logprobs.content
    assert len(items) == got.usage.completion_tokens
    assert b"".join(bytes(i.bytes) for i in items).decode() == choice.message.content
    for item in items:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and item.logprob <= 0
        for top in item.top_logprobs:
            if top.token == item.token:
                assert top.logprob == pytest.approx(item.logprob, abs=1e-5)
    greedy = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = greedy.choices[0].logprobs
    assert "".join(logprobs.tokens) == greedy.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob == pytest.approx(max(top.values()), abs=1e-5) and top[token] == pytest.approx(logprob, abs=1e-5)  # greedy: the likeliest


def test_n_samples_are_choices_with_their_own_seeded_texts(sdk, model):
    fields = dict(model=model, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=5, n=4, extra_body={"ignore_eos": True})
    got = sdk.completions.create(**fields)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    texts = [c.text for c in got.choices]
    assert len(set(texts)) == 4
    assert (got.usage.completion_tokens, got.usage.total_tokens) == (96, got.usage.prompt_tokens + 96)
    streamed, finishes = defaultdict(str), {}
    chunks = list(sdk.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [streamed[i] for i in range(4)] == texts and finishes == {i: "length" for i in range(4)}
    assert chunks[-1].usage.completion_tokens == 96


def test_tool_choice_required_and_named_return_valid_calls(sdk, model):
    got = sdk.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=64)
    [choice] = got.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert (call.type, call.function.name) == ("function", "get_weather") and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = sdk.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=48)
    [call] = got.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=48, stream=True))
    [delta] = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert delta[0].function.arguments == call.function.arguments


def test_a_template_without_a_tool_format_answers_content(sdk, model):
    got = sdk.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, max_tokens=24, temperature=0)
    assert got.choices[0].message.tool_calls is None and got.choices[0].message.content


def test_a_bad_constraint_is_a_400_naming_the_field(http_address, model):
    for body, param in [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ]:
        reply = requests.post(f"http://{http_address}/v1/chat/completions", json={"model": model, "messages": ASK_PERSON, "max_tokens": 8, **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_kserve_parameters_constrain_the_answer(cluster, http_address, model):
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"My phone number is"], dtype=np.object_))
    result = client.infer(model, [prompt], parameters={"regex": " [0-9]{3}-[0-9]{4}", "max_tokens": 24, "temperature": 0.7, "seed": 3})
    [text] = result.as_numpy("text_output")
    assert re.fullmatch(r"My phone number is [0-9]{3}-[0-9]{4}", text.decode()), text
    http = httpclient.InferenceServerClient(http_address)
    prompt = httpclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"A person as JSON:"], dtype=np.object_))
    result = http.infer(model, [prompt], parameters={"json_schema": json.dumps(PERSON), "max_tokens": 64, "temperature": 0})
    [text] = result.as_numpy("text_output")
    jsonschema.validate(json.loads(text.decode().removeprefix("A person as JSON:")), PERSON)


def test_kserve_logprobs_output(cluster, http_address, model):
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"The capital of France is"], dtype=np.object_))
    result = client.infer(model, [prompt], parameters={"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2})
    [text] = result.as_numpy("text_output")
    entries = json.loads(result.as_numpy("logprobs")[0])
    assert len(entries) == 6 and text.decode() == "The capital of France is" + "".join(e["token"] for e in entries)
    for entry in entries:  # greedy: the sampled token is the likeliest
        assert [t["logprob"] for t in entry["top"]] == sorted((t["logprob"] for t in entry["top"]), reverse=True) and len(entry["top"]) == 2
        assert (entry["top"][0]["token_id"], entry["top"][0]["logprob"]) == (entry["token_id"], pytest.approx(entry["logprob"], abs=1e-5))
    url = f"http://{http_address}/v2/models/{model}"
    reply = requests.post(f"{url}/generate", json={"text_input": "The capital of France is", "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}})
    assert [e["token_id"] for e in reply.json()["logprobs"]] == [e["token_id"] for e in entries]
