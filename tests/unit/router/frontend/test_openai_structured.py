"""OpenAI sampling features and structured outputs to SamplingParams: the exact proto fields
each body sets, and the 400 naming the field each bad one gets."""

import json

import pytest

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError
from router.frontend.apis.openai_schema import parse_chat, parse_completion

MODELS = {"m": pb.ModelInfo(id="m", max_model_len=512)}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]}


def test_sampling_features_become_their_proto_fields():
    body = {**CHAT, "n": 3, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "seed": 7,
            "logit_bias": {"50256": -100, "13": 2.5}, "min_tokens": 4, "max_tokens": 20, "logprobs": True, "top_logprobs": 5}
    parsed = parse_chat(body, MODELS)
    s = parsed.generate.sampling
    assert (s.n, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.seed, s.min_tokens, s.logprobs) == (3, 0.5, -1.0, pytest.approx(1.2), 7, 4, 5)
    assert dict(s.logit_bias) == {50256: -100.0, 13: 2.5}
    assert (parsed.num_choices, parsed.logprobs, parsed.constraint_field, parsed.tools) == (3, 5, None, None)
    assert not s.HasField("prompt_logprobs") and s.constraint.WhichOneof("kind") is None


def test_defaults_leave_every_new_field_unset():
    parsed = parse_chat({**CHAT, "n": 1, "logprobs": False}, MODELS)
    s = parsed.generate.sampling
    for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs"):
        assert not s.HasField(name), name
    assert (parsed.num_choices, parsed.logprobs, len(s.logit_bias)) == (1, None, 0)


def test_logprobs_true_without_top_logprobs_asks_for_no_alternatives():
    parsed = parse_chat({**CHAT, "logprobs": True}, MODELS)
    assert (parsed.logprobs, parsed.generate.sampling.logprobs) == (0, 0)


def test_completion_logprobs_is_an_integer_up_to_20():
    parsed = parse_completion({"model": "m", "prompt": "hi", "logprobs": 20, "n": 2}, MODELS)
    assert (parsed.logprobs, parsed.generate.sampling.logprobs, parsed.generate.sampling.n) == (20, 20, 2)
    assert parse_completion({"model": "m", "prompt": "hi", "logprobs": 0}, MODELS).logprobs == 0


@pytest.mark.parametrize("body, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}, "json_schema", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": False}}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
])
def test_constraints_from_response_format_and_structured_outputs(body, kind, value):
    parsed = parse_chat({**CHAT, **body}, MODELS)
    constraint = parsed.generate.sampling.constraint
    assert constraint.WhichOneof("kind") == kind
    got = getattr(constraint, kind)
    assert (json.loads(got) if kind == "json_schema" else got) == value
    assert parsed.constraint_field == ("response_format" if "response_format" in body else f"structured_outputs.{next(iter(body['structured_outputs']))}")


def test_choice_and_grammar_constraints():
    choice = parse_chat({**CHAT, "structured_outputs": {"choice": ["yes", "no"]}}, MODELS).generate.sampling.constraint
    assert list(choice.choice.choices) == ["yes", "no"]
    grammar = parse_completion({"model": "m", "prompt": "x", "structured_outputs": {"grammar": "root ::= \"a\"", "grammar_syntax": "ebnf"}}, MODELS)
    assert (grammar.generate.sampling.constraint.grammar.source, grammar.generate.sampling.constraint.grammar.syntax) == ('root ::= "a"', "ebnf")
    lark = parse_chat({**CHAT, "structured_outputs": {"grammar": "start: \"a\""}}, MODELS).generate.sampling.constraint.grammar
    assert lark.syntax == "lark"
    text = parse_chat({**CHAT, "response_format": {"type": "text"}}, MODELS)
    assert text.generate.sampling.constraint.WhichOneof("kind") is None and text.constraint_field is None


@pytest.mark.parametrize("body, param, message", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs: must be in [0, 20], got 21"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs: only allowed when logprobs is true"),
    ({"top_logprobs": 2, "logprobs": False}, "top_logprobs", "top_logprobs: only allowed when logprobs is true"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty: must be in [-2, 2], got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty: must be > 0 (1 is off), got 0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias: keys must be token ids (integers >= 0, as strings), got 'abc'"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "logit_bias: keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias: bias of token 5 must be a number in [-100, 100], got 101"),
    ({"logit_bias": [1]}, "logit_bias", "logit_bias: must be an object of token id -> bias, got list"),
    ({"min_tokens": 30, "max_tokens": 20}, "min_tokens", "min_tokens: must be in [0, max_tokens=20], got 30"),
    ({"n": "2"}, "n", "n: must be an integer, got '2'"),
    ({"response_format": "json"}, "response_format", "response_format: must be an object with a type, got str"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "response_format.json_schema: must be an object with name and schema, got NoneType"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}}, "response_format.json_schema.schema", "response_format.json_schema.schema: must be a JSON Schema object, got str"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name", "response_format.json_schema.name: must be 1-64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict", "response_format.json_schema.strict: must be true or false"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "structured_outputs: give exactly one of json, json_object, regex, choice, grammar (got regex, choice)"),
    ({"structured_outputs": {}}, "structured_outputs", "structured_outputs: give exactly one of json, json_object, regex, choice, grammar (got none)"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "structured_outputs.json: not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "structured_outputs.json: must be a JSON Schema object (or its JSON text), got list"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "structured_outputs.choice: must be a non-empty array of non-empty strings"),
    ({"structured_outputs": {"grammar": "x", "grammar_syntax": "peg"}}, "structured_outputs.grammar_syntax", "structured_outputs.grammar_syntax: must be lark or ebnf, got 'peg'"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "structured_outputs: give either response_format or structured_outputs, not both"),
    ({"guided_json": SCHEMA}, "guided_json", "guided_json: not supported; use structured_outputs"),
])
def test_bad_sampling_and_structured_fields_name_the_field(body, param, message):
    with pytest.raises(APIError) as e:
        parse_chat({**CHAT, **body}, MODELS)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message), e.value.message


def test_completion_logprobs_out_of_range_and_n_past_the_router_max():
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "logprobs": 21}, MODELS)
    assert (e.value.param, e.value.message) == ("logprobs", "logprobs: must be in [0, 20], got 21")
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", "n": 5}, MODELS, max_n=4)
    assert (e.value.param, e.value.message) == ("n", "n: must be in [1, 4], got 5")


def test_the_engines_refusal_of_a_constraint_names_the_clients_field():
    from router.frontend.apis.openai_api import _named_constraint

    engine = APIError(400, "constraint.json_schema: unknown type 'bogus'", param="constraint.json_schema", code="invalid_argument")
    named = _named_constraint(engine, "response_format")
    assert (named.status, named.param, named.message, named.code) == (400, "response_format", "response_format: constraint.json_schema: unknown type 'bogus'", "invalid_argument")
    other = APIError(400, "max_tokens: too many", param="max_tokens")
    assert _named_constraint(other, "response_format") is other and _named_constraint(engine, None) is engine
