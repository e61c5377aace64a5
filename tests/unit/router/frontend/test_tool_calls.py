"""Tools and tool_choice: what a request becomes, which parser a chat template gets, what each
parser reads in example outputs (Hermes, Llama JSON, malformed), and the constrained choices."""

import json

import pytest

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError
from router.frontend.apis.openai_schema import parse_chat
from router.frontend.apis.openai_tools import ToolPlan, finish_reason, read_calls, required_schema, tool_call_bodies
from router.frontend.apis.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall, ParsedOutput, parser_for_template, parser_named
from router.routing.tokenization import chat_message

MODELS = {"m": pb.ModelInfo(id="m", max_model_len=512)}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": TOOLS}
QWEN_TEMPLATE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> reply <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
LLAMA_TEMPLATE = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. {{- "<|python_tag|>" }}'


def test_tools_go_to_the_template_and_auto_is_the_default():
    parsed = parse_chat(CHAT, MODELS)
    assert json.loads(parsed.generate.tools_json) == TOOLS
    assert parsed.tools == ToolPlan("auto") and parsed.constraint_field is None
    assert parsed.generate.sampling.constraint.WhichOneof("kind") is None
    assert parse_chat({**CHAT, "tool_choice": "none"}, MODELS).tools == ToolPlan("none")


def test_required_constrains_to_an_array_of_calls_of_the_given_tools():
    parsed = parse_chat({**CHAT, "tool_choice": "required"}, MODELS)
    schema = json.loads(parsed.generate.sampling.constraint.json_schema)
    assert schema == required_schema({"get_weather": WEATHER, "now": {"type": "object", "properties": {}}})
    assert schema["minItems"] == 1 and [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "now"}]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER
    assert (parsed.tools, parsed.constraint_field) == (ToolPlan("required"), "tool_choice")


def test_parallel_tool_calls_false_allows_one_required_call():
    parsed = parse_chat({**CHAT, "tool_choice": "required", "parallel_tool_calls": False}, MODELS)
    schema = json.loads(parsed.generate.sampling.constraint.json_schema)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in json.loads(parse_chat({**CHAT, "tool_choice": "required", "parallel_tool_calls": True}, MODELS).generate.sampling.constraint.json_schema)


def test_a_named_function_constrains_to_its_parameters():
    parsed = parse_chat({**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, MODELS)
    assert json.loads(parsed.generate.sampling.constraint.json_schema) == WEATHER
    assert parsed.tools == ToolPlan("function", "get_weather")


def test_tool_calls_and_tool_messages_map_to_chat_message_fields():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "rain"},
    ]
    g = parse_chat({**CHAT, "messages": messages}, MODELS).generate
    assert g.messages[1] == pb.ChatMessage(role="assistant", content="", tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments_json="{\"city\": \"Oslo\"}")])
    assert g.messages[2] == pb.ChatMessage(role="tool", content="rain", tool_call_id="call_1", name="get_weather")
    # what the chat template gets, as transformers passes it
    assert chat_message(g.messages[1]) == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert chat_message(g.messages[2]) == {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize("body, param, message", [
    ({"tools": {"a": 1}}, "tools", "tools: must be a list of tool definitions, got dict"),
    ({"tools": [{"type": "code"}]}, "tools[0].type", "tools[0].type: must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "tools[0].function.name: must be 1-64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters", "tools[0].function.parameters: must be a JSON Schema object, got list"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name", "tools[1].function.name: 'now' is given twice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "tool_choice: names no tool given: 'nope' (tools: get_weather, now)"),
    ({"tool_choice": "always"}, "tool_choice", "tool_choice: must be none, auto, required or"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice: only allowed when tools are given"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "tool_choice: a required or named tool choice cannot be combined with response_format"),
    ({"functions": [{"name": "f"}]}, "functions", "functions: not supported; use tools and tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "messages[0].tool_call_id: required"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "messages[0].tool_calls[0].function.arguments: not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "messages[0].tool_calls[0].function.arguments: must be a string of JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls[0]", "messages[0].tool_calls[0]: must be"),
])
def test_bad_tools_name_the_field(body, param, message):
    with pytest.raises(APIError) as e:
        parse_chat({**CHAT, **body}, MODELS)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message), e.value.message


def test_the_parser_is_chosen_by_the_template():
    assert isinstance(parser_for_template(QWEN_TEMPLATE), HermesParser)
    assert isinstance(parser_for_template(LLAMA_TEMPLATE), Llama3JsonParser)
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert isinstance(parser_named("llama3_json"), Llama3JsonParser)


@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     ParsedOutput(None, (ParsedCall("get_weather", '{"city": "Oslo"}'),))),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
     ParsedOutput("Let me check.", (ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("now", "{}")))),
    ('<tool_call>{"name": "now", "arguments": "{}"}', ParsedOutput(None, (ParsedCall("now", "{}"),))),  # cut before its end tag
    ("It is sunny.", ParsedOutput("It is sunny.")),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', ParsedOutput('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>')),
    ('<tool_call>{"arguments": {}}</tool_call>', ParsedOutput('<tool_call>{"arguments": {}}</tool_call>')),
])
def test_hermes_parser(text, want):
    assert HermesParser().parse(text) == want


@pytest.mark.parametrize("text, want", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', ParsedOutput(None, (ParsedCall("get_weather", '{"city": "Oslo"}'),))),
    ('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     ParsedOutput(None, (ParsedCall("now", "{}"), ParsedCall("get_weather", '{"city": "Rome"}')))),
    ("The weather is fine.", ParsedOutput("The weather is fine.")),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"', ParsedOutput('{"name": "get_weather", "parameters": {"city": "Oslo"')),
    ('{"city": "Oslo"}', ParsedOutput('{"city": "Oslo"}')),
    ('{"name": "now", "parameters": {}} and some prose', ParsedOutput('{"name": "now", "parameters": {}} and some prose')),
])
def test_llama3_json_parser(text, want):
    assert Llama3JsonParser().parse(text) == want


def test_where_a_streamed_call_may_begin():
    hermes, llama = HermesParser(), Llama3JsonParser()
    assert [hermes.call_start(t) for t in ("Hello", "Hello <tool", "Hello <tool_call>{", "a<b")] == [None, 6, 6, None]
    assert [llama.call_start(t) for t in ("", "  ", ' {"na', "<|python", "Sure")] == [0, 0, 0, 0, None]


def test_constrained_answers_are_read_as_calls():
    required = ToolPlan("required")
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]'
    parsed = read_calls(required, None, text)
    assert parsed == ParsedOutput(None, (ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("now", "{}")))
    assert finish_reason(required, parsed, "stop") == "tool_calls"
    named = ToolPlan("function", "get_weather")
    parsed = read_calls(named, None, '{"city": "Oslo"}')
    assert parsed == ParsedOutput(None, (ParsedCall("get_weather", '{"city": "Oslo"}'),))
    assert finish_reason(named, parsed, "stop") == "stop"
    cut = read_calls(required, None, '[{"name": "get_weather", "argu')  # finish_reason length
    assert cut == ParsedOutput('[{"name": "get_weather", "argu') and finish_reason(required, cut, "length") == "length"
    assert read_calls(ToolPlan("none"), HermesParser(), "<tool_call>{\"name\": \"now\"}</tool_call>").calls == ()
    assert read_calls(ToolPlan("auto"), None, "<tool_call>{\"name\": \"now\"}</tool_call>").calls == ()  # the template teaches no format


def test_tool_call_bodies_have_the_openai_shape():
    [body] = tool_call_bodies((ParsedCall("now", "{}"),))
    assert body["id"].startswith("call_") and len(body["id"]) == 29
    assert {k: v for k, v in body.items() if k != "id"} == {"type": "function", "function": {"name": "now", "arguments": "{}"}}
    assert tool_call_bodies((ParsedCall("now", "{}"),), with_index=True)[0]["index"] == 0
