"""KServe parameters for sampling features and constraints: the proto fields they set, the
refusals naming the parameter, and the ``logprobs`` output's JSON."""

import json

import pytest
from tritonclient.grpc import service_pb2 as kpb

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError
from router.frontend.apis.kserve_grpc import infer_response
from router.frontend.apis.tensors import Tensor, llm_request, logprobs_json, named_constraint

PROMPT = {"text_input": Tensor("text_input", "BYTES", (1,), [b"Hi"])}
SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


def sampling_input(values: dict) -> dict:
    return {**PROMPT, "sampling_parameters": Tensor("sampling_parameters", "BYTES", (1,), [json.dumps(values).encode()])}


def test_parameters_set_the_sampling_features():
    parameters = {"presence_penalty": "0.5", "frequency_penalty": -1, "repetition_penalty": 1.1, "min_tokens": "3",
                  "logprobs": 2, "n": 1, "seed": "11", "max_tokens": 8, "triton_enable_empty_final_response": True}
    llm = llm_request("m", PROMPT, parameters)
    s = llm.generate.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.logprobs, s.seed) == (0.5, -1.0, pytest.approx(1.1), 3, 2, 11)
    assert not s.HasField("n") and llm.generate.stop.max_tokens == 8
    assert (llm.logprobs, llm.constraint_field) == (True, None)
    assert not llm_request("m", PROMPT, {}).logprobs


@pytest.mark.parametrize("parameters, kind, value", [
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"json_object": True}, "json_object", True),
    ({"json_object": "true"}, "json_object", True),
    ({"regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"choice": '["red", "blue"]'}, "choice", ["red", "blue"]),
    ({"grammar": 'start: "a"'}, "grammar", ('start: "a"', "lark")),
    ({"grammar": 'root ::= "a"', "grammar_syntax": "ebnf"}, "grammar", ('root ::= "a"', "ebnf")),
])
def test_constraint_parameters(parameters, kind, value):
    llm = llm_request("m", PROMPT, parameters)
    constraint = llm.generate.sampling.constraint
    assert constraint.WhichOneof("kind") == kind
    got = {"json_schema": lambda: json.loads(constraint.json_schema), "json_object": lambda: constraint.json_object, "regex": lambda: constraint.regex,
           "choice": lambda: list(constraint.choice.choices), "grammar": lambda: (constraint.grammar.source, constraint.grammar.syntax)}[kind]()
    assert got == value
    assert llm.constraint_field == f"parameters.{kind}"


def test_constraints_in_sampling_parameters_may_be_json_values():
    llm = llm_request("m", sampling_input({"json_schema": SCHEMA, "choice": None}))
    assert json.loads(llm.generate.sampling.constraint.json_schema) == SCHEMA
    assert llm.constraint_field == "sampling_parameters.json_schema"
    assert list(llm_request("m", sampling_input({"choice": ["a", "b"]})).generate.sampling.constraint.choice.choices) == ["a", "b"]


@pytest.mark.parametrize("parameters, message", [
    ({"regex": "a", "json_object": True}, "parameters.regex: give at most one of json_schema, json_object, regex, choice, grammar (got json_object, regex)"),
    ({"json_schema": "{nope"}, "parameters.json_schema: not valid JSON"),
    ({"json_schema": "[1]"}, "parameters.json_schema: must be a JSON Schema object (or its JSON text), got list"),
    ({"choice": "red"}, "parameters.choice: not valid JSON"),
    ({"choice": "[]"}, "parameters.choice: must be a non-empty array of non-empty strings"),
    ({"regex": ""}, "parameters.regex: must be a non-empty string"),
    ({"grammar": "x", "grammar_syntax": "peg"}, "parameters.grammar_syntax: must be lark or ebnf, got 'peg'"),
    ({"grammar_syntax": "lark"}, "parameters.grammar_syntax: only with grammar"),
    ({"json_object": "maybe"}, "parameters.json_object: must be true or false, got 'maybe'"),
    ({"n": 2}, "parameters.n: only 1 sample per KServe request (the OpenAI API's n gives more), got 2"),
    ({"logprobs": "many"}, "parameters.logprobs: must be an integer, got 'many'"),
    ({"presence_penalty": "high"}, "parameters.presence_penalty: must be a number, got 'high'"),
])
def test_bad_parameters_name_the_parameter(parameters, message):
    with pytest.raises(APIError) as e:
        llm_request("m", PROMPT, parameters)
    assert (e.value.status, e.value.message[: len(message)]) == (400, message)


def test_sampling_parameters_win_and_are_named_as_such():
    llm = llm_request("m", sampling_input({"temperature": 0.5}), {"temperature": 1.5})
    assert llm.generate.sampling.temperature == 0.5
    with pytest.raises(APIError) as e:
        llm_request("m", sampling_input({"regex": "a", "json_object": True}))
    assert e.value.message.startswith("sampling_parameters.regex: give at most one of")


def test_the_logprobs_output():
    entries = [pb.TokenLogprobs(token_id=5, logprob=-0.5, top=[pb.TopLogprob(token_id=5, logprob=-0.5), pb.TopLogprob(token_id=6, logprob=-1.0)])]
    text = logprobs_json(entries, lambda token_id: (f"t{token_id}", []))
    assert json.loads(text) == [{"token_id": 5, "token": "t5", "logprob": -0.5, "top": [
        {"token_id": 5, "token": "t5", "logprob": -0.5}, {"token_id": 6, "token": "t6", "logprob": -1.0}]}]
    response = infer_response(kpb.ModelInferRequest(model_name="m"), "hi", final=True, logprobs=text)
    assert [o.name for o in response.outputs] == ["text_output", "logprobs"]
    assert response.raw_output_contents[1][4:].decode() == text
    assert [o.name for o in infer_response(kpb.ModelInferRequest(model_name="m"), "hi", final=True).outputs] == ["text_output"]


def test_the_engines_refusal_of_a_constraint_names_the_parameter():
    assert named_constraint("constraint.regex: does not compile", "parameters.regex") == "parameters.regex: constraint.regex: does not compile"
    assert named_constraint("max_tokens: too many", "parameters.regex") == "max_tokens: too many"
