"""KServe v2 / Triton inference protocol on a real local cluster, driven by the real
``tritonclient.grpc`` and ``tritonclient.http`` with the vLLM backend's tensor convention."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import wait_until
from tests.integration.http_cluster import cluster, grpc_client, http_address, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"
SAMPLING = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def want(grpc_client):
    """The text our own gRPC API generates for PROMPT and SAMPLING."""
    return "".join(r.text for r in grpc_client.generate(PROMPT, **SAMPLING))


def llm_inputs(module, prompt: str, stream: bool, sampling: dict, exclude_input: bool | None = None) -> list:
    tensors = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
               ("stream", np.array([stream], dtype=bool), "BOOL"),
               ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES")]
    if exclude_input is not None:
        tensors.append(("exclude_input_in_output", np.array([exclude_input], dtype=bool), "BOOL"))
    inputs = []
    for name, data, datatype in tensors:
        tensor = module.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def text_of(result) -> str:
    [text] = result.as_numpy("text_output")
    return text.decode() if isinstance(text, bytes) else text  # binary data comes back as bytes, JSON data as str


def test_grpc_health_metadata_and_infer(cluster, model, want):
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    assert not client.is_model_ready("no-such-model")
    metadata = client.get_model_metadata(model, as_json=True)
    assert [(i["name"], i["datatype"]) for i in metadata["inputs"]] == [
        ("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"), ("exclude_input_in_output", "BOOL")]
    assert client.get_model_config(model, as_json=True)["config"]["model_transaction_policy"]["decoupled"] is True
    result = client.infer(model, llm_inputs(grpcclient, PROMPT, False, SAMPLING, exclude_input=True))
    assert text_of(result) == want
    assert text_of(client.infer(model, llm_inputs(grpcclient, PROMPT, False, SAMPLING))) == PROMPT + want


def test_grpc_stream_infer_with_a_callback(cluster, model, want):
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, llm_inputs(grpcclient, PROMPT, True, SAMPLING), request_id="r1")
    client.async_stream_infer(model, llm_inputs(grpcclient, PROMPT, True, {"temperature": "hot"}), request_id="r2")
    pieces, errors, finals = [], [], 0
    while finals < 1 or not errors:
        result, error = results.get(timeout=30)
        if error is not None:
            errors.append(str(error))
            continue
        response = result.get_response()
        assert response.id == "r1"
        pieces.append(text_of(result))
        finals += response.parameters["triton_final_response"].bool_param
    client.stop_stream()
    assert len(pieces) > 1 and "".join(pieces) == want  # one response per piece, the prompt left out
    assert errors == ["sampling_parameters.temperature: must be a number, got 'hot'"]


def test_grpc_bad_tensors_are_invalid_argument(cluster, model):
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    wrong_type = grpcclient.InferInput("text_input", [1], "FP32")
    wrong_type.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    two_prompts = grpcclient.InferInput("text_input", [2], "BYTES")
    two_prompts.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    for inputs, name, message in [
        ([wrong_type], model, "text_input: datatype must be BYTES, got FP32"),
        ([two_prompts], model, "text_input: shape [2] must hold exactly one element"),
        (llm_inputs(grpcclient, "", False, {}), model, "text_input: must not be empty"),
        (llm_inputs(grpcclient, "hi", False, {"max_tokens": 0}), model, "max_tokens: must be an integer >= 1"),
        (llm_inputs(grpcclient, "hi", False, {}), "no-such-model", "model: 'no-such-model' is not served here"),
    ]:
        with pytest.raises(InferenceServerException) as e:
            client.infer(name, inputs)
        assert message in e.value.message(), e.value.message()
        assert e.value.status() in ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND")
    assert text_of(client.infer(model, llm_inputs(grpcclient, "still", False, {"max_tokens": 2}, exclude_input=True)))


def test_http_client_and_generate_endpoints(http_address, model, want):
    client = httpclient.InferenceServerClient(http_address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    assert client.get_model_metadata(model)["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}, {"name": "logprobs", "datatype": "BYTES", "shape": [-1]}]
    inputs = llm_inputs(httpclient, PROMPT, False, SAMPLING, exclude_input=True)
    assert text_of(client.infer(model, inputs)) == want  # binary tensors both ways
    assert text_of(client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("text_output", binary_data=False)])) == want
    with pytest.raises(InferenceServerException) as e:
        client.infer("no-such-model", inputs)
    assert "is not served here" in e.value.message()

    url = f"http://{http_address}/v2/models/{model}"
    body = {"text_input": PROMPT, "parameters": SAMPLING, "exclude_input_in_output": True}
    assert requests.post(f"{url}/generate", json=body).json()["text_output"] == want
    with requests.post(f"{url}/generate_stream", json=body, stream=True) as reply:
        events = [json.loads(line[len(b"data: "):]) for line in reply.iter_lines() if line]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == want
    bad = requests.post(f"{url}/generate", json={"text_input": PROMPT, "stream": "yes"})
    assert (bad.status_code, bad.json()) == (400, {"error": "stream: must be a boolean, got 'yes'"})


def test_a_cancelled_grpc_stream_frees_its_blocks(cluster, model, grpc_client):
    def idle():
        [r] = grpc_client.cluster_status().replicas
        return r.num_running == 0 and r.num_free_kv_blocks == r.num_kv_blocks and r

    before = wait_until(idle)
    client = grpcclient.InferenceServerClient(cluster.router_status.grpc_address)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, llm_inputs(grpcclient, PROMPT, True, {"max_tokens": 450, "ignore_eos": True}))
    assert results.get(timeout=30)[1] is None
    client.stop_stream(cancel_requests=True)
    after = wait_until(idle)
    assert after.num_aborted_requests == before.num_aborted_requests + 1
