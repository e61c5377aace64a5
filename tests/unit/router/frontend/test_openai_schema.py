"""OpenAI request bodies to GenerateRequests: what each field becomes, and the 400 (or 404, 503)
each bad body gets, naming the field."""

import pytest

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError
from router.frontend.apis.openai_schema import parse_chat, parse_completion

MODELS = {"m": pb.ModelInfo(id="m", max_model_len=512)}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_completion_body_becomes_a_generate_request():
    parsed = parse_completion(
        {"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n",
         "top_k": 4, "stop_token_ids": [2], "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": "u"},
        MODELS,
    )
    g = parsed.generate
    assert (parsed.model, parsed.stream, parsed.include_usage) == ("m", True, True)
    assert (list(g.prompt_token_ids), g.HasField("prompt"), g.model) == ([5, 6, 7], False, "m")
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.sampling.seed) == (0.0, 0.5, 4, 3)
    assert (g.stop.max_tokens, list(g.stop.stop), list(g.stop.stop_token_ids), g.stop.ignore_eos) == (9, ["\n"], [2], True)


def test_defaults_completion_16_tokens_chat_the_context_and_sampling_left_to_the_engine():
    completion = parse_completion({"model": "m", "prompt": "hi"}, MODELS).generate
    chat = parse_chat(CHAT, MODELS).generate
    assert (completion.prompt, completion.stop.max_tokens, chat.stop.max_tokens) == ("hi", 16, 512)
    assert not chat.sampling.HasField("temperature") and not chat.sampling.HasField("seed")


def test_chat_messages_roles_and_text_parts():
    body = {**CHAT, "max_tokens": 3, "max_completion_tokens": 5, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]}
    g = parse_chat(body, MODELS).generate
    assert [(m.role, m.content) for m in g.messages] == [("system", "be brief"), ("user", "ab"), ("assistant", "")]
    assert g.stop.max_tokens == 5  # max_completion_tokens wins


@pytest.mark.parametrize("body, status, param, message", [
    ({**CHAT, "model": "x"}, 404, "model", "model: 'x' is not served here (served: m)"),
    ({"messages": CHAT["messages"]}, 400, "model", "model: required: a model id from GET /v1/models"),
    ({"model": "m"}, 400, "messages", "messages: required"),
    ({**CHAT, "messages": []}, 400, "messages", "messages: must be a non-empty list"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "messages[0].role: must be one of system, developer, user, assistant, tool, got 'robot'"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "messages[0].content: must be a string or a list of text parts, got int"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", "messages[0].content[0]: only text parts"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens", "max_tokens: must be in [1, 2147483647], got 0"),
    ({**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens", "max_completion_tokens: must be in [1,"),
    ({**CHAT, "max_tokens": "5"}, 400, "max_tokens", "max_tokens: must be an integer, got '5'"),
    ({**CHAT, "temperature": 3}, 400, "temperature", "temperature: must be in [0, 2], got 3"),
    ({**CHAT, "temperature": True}, 400, "temperature", "temperature: must be a number, got True"),
    ({**CHAT, "top_p": 0}, 400, "top_p", "top_p: must be in (0, 1], got 0"),
    ({**CHAT, "top_k": -1}, 400, "top_k", "top_k: must be in [0,"),
    ({**CHAT, "n": 0}, 400, "n", "n: must be in [1, 16], got 0"),
    ({**CHAT, "n": 17}, 400, "n", "n: must be in [1, 16], got 17"),
    ({**CHAT, "stop": ["a", 1]}, 400, "stop", "stop: must be a non-empty string or a list of them"),
    ({**CHAT, "stream": "yes"}, 400, "stream", "stream: must be true or false, got 'yes'"),
    ({**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream_options: only allowed when stream is true"),
    ({**CHAT, "echo": True}, 400, "echo", "echo: not supported by splitserve"),
    ({**CHAT, "best_of": 2}, 400, "best_of", "best_of: not supported by splitserve"),
    ({**CHAT, "logprobs": 1}, 400, "logprobs", "logprobs: must be true or false, got 1"),
    ({**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", "tools[0].function: must be an object with a name"),
    ({**CHAT, "presence_penalty": 2.5}, 400, "presence_penalty", "presence_penalty: must be in [-2, 2], got 2.5"),
    ({**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type", "response_format.type: must be one of text, json_object, json_schema, got 'xml'"),
])
def test_bad_chat_bodies_name_the_field(body, status, param, message):
    with pytest.raises(APIError) as e:
        parse_chat(body, MODELS)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.message.startswith(message), e.value.message


@pytest.mark.parametrize("prompt, message", [
    (None, "prompt: required"),
    ("", "prompt: must not be empty"),
    ([], "prompt: must not be empty"),
    (["a", "b"], "prompt: one prompt per request (n=1), got a batch of 2"),
    ([1, -2], "prompt: token id -2 is out of range"),
    (3.5, "prompt: must be a string or a list of token ids, got float"),
])
def test_bad_prompts_name_the_field(prompt, message):
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": prompt}, MODELS)
    assert (e.value.status, e.value.message) == (400, message)


def test_no_live_replica_is_503_and_a_non_object_body_400():
    with pytest.raises(APIError) as e:
        parse_chat(CHAT, {})
    assert (e.value.status, e.value.message) == (503, "no live decode worker")
    with pytest.raises(APIError) as e:
        parse_chat([1], MODELS)
    assert (e.value.status, e.value.message) == (400, "request body: must be a JSON object, got list")
