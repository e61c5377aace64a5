"""KServe v2 tensors and the vLLM backend's LLM convention: codecs and what a request becomes."""

import json

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.utils import serialize_byte_tensor

from router.frontend.apis.errors import APIError
from router.frontend.apis.kserve_grpc import grpc_inputs, infer_response
from router.frontend.apis.tensors import Tensor, deserialize_bytes, llm_request, serialize_bytes


def bytes_tensor(name, *values):
    return Tensor(name, "BYTES", (len(values),), list(values))


def test_bytes_codec_matches_tritonclient():
    items = [b"", b"hello", "é".encode()]
    wire = serialize_byte_tensor(np.array(items, dtype=np.object_)).item()
    assert serialize_bytes(items) == wire
    assert deserialize_bytes("x", wire) == items


@pytest.mark.parametrize("wire, message", [
    (b"\x05\x00", "x: BYTES data ends inside a length prefix at byte 0"),
    (b"\x09\x00\x00\x00abc", "x: BYTES element of 9 bytes overruns the 7-byte tensor"),
])
def test_truncated_bytes_are_refused(wire, message):
    with pytest.raises(APIError) as e:
        deserialize_bytes("x", wire)
    assert e.value.message == message


def test_an_llm_request_maps_the_vllm_convention():
    sampling = json.dumps({"max_tokens": 7, "temperature": "0.5", "top_k": 3, "stop": "\n", "stop_token_ids": [2], "ignore_eos": "true", "seed": 9})
    inputs = {
        "text_input": bytes_tensor("text_input", b"Hi"),
        "stream": Tensor("stream", "BOOL", (1, 1), [True]),
        "sampling_parameters": bytes_tensor("sampling_parameters", sampling.encode()),
        "exclude_input_in_output": Tensor("exclude_input_in_output", "BOOL", (1,), [True]),
    }
    llm = llm_request("m", inputs, {"max_tokens": 99, "top_p": 0.25, "triton_enable_empty_final_response": True})
    g = llm.generate
    assert (llm.stream, llm.exclude_input_in_output, llm.prompt, g.model, g.prompt) == (True, True, "Hi", "m", "Hi")
    assert (g.stop.max_tokens, list(g.stop.stop), list(g.stop.stop_token_ids), g.stop.ignore_eos) == (7, ["\n"], [2], True)  # the tensor wins
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.sampling.seed) == (0.5, 0.25, 3, 9)


@pytest.mark.parametrize("inputs, message", [
    ({}, "text_input: required input is missing"),
    ({"text_input": bytes_tensor("text_input", b"")}, "text_input: must not be empty"),
    ({"text_input": bytes_tensor("text_input", b"\xff")}, "text_input: not valid UTF-8"),
    ({"text_input": Tensor("text_input", "BYTES", (1,), [])}, "text_input: shape [1] holds one element but the data has 0"),
    ({"text_input": bytes_tensor("text_input", b"a"), "stream": Tensor("stream", "INT32", (1,), [1])}, "stream: datatype must be BOOL, got INT32"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b"[1]")}, "sampling_parameters: must be a JSON object, got list"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b"{")}, "sampling_parameters: not valid JSON"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b'{"best_of": 2}')}, "sampling_parameters.best_of: unknown parameter"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b'{"n": 2}')}, "sampling_parameters.n: only 1 sample per KServe request"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b'{"top_k": 1.5}')}, "sampling_parameters.top_k: must be an integer, got 1.5"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b'{"max_tokens": 1e12}')}, "sampling_parameters.max_tokens: 1000000000000.0 is out of range"),
    ({"text_input": bytes_tensor("text_input", b"a"), "sampling_parameters": bytes_tensor("sampling_parameters", b'{"stop": [1]}')}, "sampling_parameters.stop: must be a list, got [1]"),
])
def test_bad_llm_requests_name_the_field(inputs, message):
    with pytest.raises(APIError) as e:
        llm_request("m", inputs)
    assert (e.value.status, e.value.message[: len(message)]) == (400, message)


def test_grpc_inputs_from_raw_contents_and_typed_contents():
    request = kpb.ModelInferRequest(model_name="m")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    request.raw_input_contents.extend([serialize_bytes([b"hey"]), b"\x01"])
    tensors = grpc_inputs(request)
    assert (tensors["text_input"].values, tensors["stream"].values) == ([b"hey"], [True])
    typed = kpb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"yo")
    assert grpc_inputs(typed)["text_input"].values == [b"yo"]
    request.raw_input_contents.pop()
    with pytest.raises(APIError) as e:
        grpc_inputs(request)
    assert e.value.message == "raw_input_contents: 1 buffers for 2 inputs"


def test_infer_response_carries_text_output_and_the_final_flag():
    request = kpb.ModelInferRequest(model_name="m", id="r")
    response = infer_response(request, "hé", final=True)
    assert (response.id, response.model_name, response.outputs[0].name, response.outputs[0].datatype) == ("r", "m", "text_output", "BYTES")
    assert deserialize_bytes("t", response.raw_output_contents[0]) == ["hé".encode()]
    assert response.parameters["triton_final_response"].bool_param is True
    assert not infer_response(request, None, final=True).outputs  # an empty final response
