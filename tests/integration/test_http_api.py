"""The HTTP front ends on one real local cluster (one router with gRPC and HTTP on free ports
over the tiny model; one start for the module):

- the OpenAI-compatible API, driven by the real ``openai`` SDK (sync and async, streaming and
  not) and by raw HTTP where the SDK would refuse the input first;
- the KServe v2 / Triton inference protocol, driven by the real ``tritonclient.grpc`` and
  ``tritonclient.http`` with the vLLM backend's tensor convention.
"""

from __future__ import annotations

import asyncio
import json
import queue

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from engine.config import EngineConfig
from router.client import SplitServeClient
from tests.integration.conftest import running_http_cluster, wait_until
from tests.unit.engine.helpers import random_prompts

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_model_len=512)
    with running_http_cluster(engine, max_waiting_requests=8) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


@pytest.fixture(scope="module")
def model(grpc_client) -> str:
    [info] = grpc_client.list_models()
    return info.id


# --- OpenAI-compatible API ----------------------------------------------------------------------

LONG_MAX_TOKENS = 450
"""Seconds of decoding on the tiny model: long enough to be cut short (as test_generate_api's LONG)."""


@pytest.fixture(scope="module")
def base_url(http_address):
    return f"http://{http_address}"


@pytest.fixture(scope="module")
def sdk(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def grpc_text(grpc_client, **fields) -> str:
    return "".join(r.text for r in grpc_client.generate(**fields))


def pool_is_idle(grpc_client) -> bool:
    [r] = grpc_client.cluster_status().replicas
    return r.num_running == 0 and r.num_waiting == 0 and r.num_free_kv_blocks == r.num_kv_blocks


def test_models_health_and_metrics(sdk, base_url, model, grpc_client):
    # Where the HTTP API listens is in the cluster status (`splitserve status` prints it).
    assert [r.http_url for r in grpc_client.cluster_status().routers] == [base_url]
    assert [m.id for m in sdk.models.list()] == [model]
    assert requests.get(f"{base_url}/health").status_code == 200
    sdk.completions.create(model=model, prompt="a", max_tokens=1)
    metrics = requests.get(f"{base_url}/metrics").text
    assert 'splitserve_http_requests_total{method="POST",route="/v1/completions",router="router-0",status="200"}' in metrics


def test_completions_match_the_grpc_api(sdk, grpc_client, model):
    prompt = "The capital of France is"
    want = grpc_text(grpc_client, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)
    got = sdk.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "length")
    assert (got.usage.completion_tokens, got.object) == (12, "text_completion")
    chunks = list(sdk.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (chunks[-1].choices, chunks[-1].usage.completion_tokens) == ([], 12)


def test_chat_sync_and_async_match_the_grpc_api(sdk, base_url, grpc_client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = grpc_text(grpc_client, messages=messages, max_tokens=10, temperature=0, ignore_eos=True)
    got = sdk.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert (got.choices[0].message.role, got.choices[0].message.content, got.object) == ("assistant", want, "chat.completion")

    async def async_calls():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(async_calls())
    assert whole.choices[0].message.content == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_seed_reproduces_a_sampled_completion(sdk, model):
    texts = {sdk.completions.create(model=model, prompt="Once upon", max_tokens=8, temperature=1.0, seed=7).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_cached_tokens_and_tenant_salt(sdk, model):
    [prompt] = random_prompts([40], seed=31)

    def cached(salt: str) -> int:
        got = sdk.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_headers={"x-splitserve-tenant-salt": salt})
        return got.usage.prompt_tokens_details.cached_tokens

    assert (cached("a"), cached("a"), cached("b")) == (0, 32, 0)  # 40 tokens: two full 16-token blocks cached


def test_errors_have_the_openai_shape_and_the_server_keeps_serving(sdk, base_url, model):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=model, prompt="hi", max_tokens=0)
    assert e.value.body["message"] == "max_tokens: must be in [1, 2147483647], got 0"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=model, prompt="x " * 800, max_tokens=1)  # past max_model_len: the engine refuses it
    assert e.value.body["param"] == "prompt" and "do not fit the context of 512 tokens" in e.value.body["message"]
    for body, message in [
        (b"{not json", "request body: not valid JSON"),
        (json.dumps({"model": model}).encode(), "messages: required"),
        (json.dumps({"model": model, "messages": "hi"}).encode(), "messages: must be a non-empty list"),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), "temperature: must be a number, got 'hot'"),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}).encode(), "top_logprobs: must be in [0, 20], got 21"),
    ]:
        reply = requests.post(f"{base_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message), reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
    assert sdk.completions.create(model=model, prompt="still", max_tokens=2).usage.completion_tokens == 2


def test_a_dropped_stream_frees_its_blocks(base_url, grpc_client, model):
    wait_until(lambda: pool_is_idle(grpc_client))
    [before] = grpc_client.cluster_status().replicas
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": LONG_MAX_TOKENS, "stream": True, "ignore_eos": True}
    with requests.post(f"{base_url}/v1/chat/completions", json=body, stream=True) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        [running] = grpc_client.cluster_status().replicas
        assert running.num_free_kv_blocks < running.num_kv_blocks
    # the connection is closed mid-stream: the request is aborted and every block comes back
    wait_until(lambda: pool_is_idle(grpc_client))
    [after] = grpc_client.cluster_status().replicas
    assert after.num_aborted_requests == before.num_aborted_requests + 1


def test_bench_clients_reports_http_next_to_grpc(cluster, base_url, tmp_path):
    """bench.clients' report shape (aiperf left out: it needs its own venv and a minute)."""
    from bench.clients import main

    out = tmp_path / "clients.json"
    argv = ["--address", cluster.router_status.grpc_address, "--http-address", base_url.removeprefix("http://"), "--drivers", "http", "grpc",
            "--concurrency", "2", "--num-requests", "2", "--prompt-len", "8", "--output-len", "4", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    [row] = report["runs"]
    assert set(row) == {"concurrency", "http", "grpc", "http_vs_grpc"}
    for driver in ("http", "grpc"):
        assert set(row[driver]) == {"num_requests", "output_tok_per_s", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_mean", "itl_ms_p50", "itl_ms_p90"}
        assert row[driver]["num_requests"] == 2
    assert set(row["http_vs_grpc"]) == {"output_tok_per_s_ratio", "ttft_ms_p50_ratio", "itl_ms_p50_ratio", "ttft_ms_p50_added"}


def test_bench_clients_exits_2_when_no_cluster_is_up(capsys):
    from bench.clients import main
    from bench.report import run

    assert run("clients", main, ["--address", "127.0.0.1:1", "--http-address", "127.0.0.1:1", "--drivers", "grpc"]) == 2
    assert "bench.clients: no splitserve router answers gRPC at 127.0.0.1:1" in capsys.readouterr().err


def test_a_client_that_gives_up_on_a_whole_completion_frees_its_blocks(base_url, grpc_client, model):
    wait_until(lambda: pool_is_idle(grpc_client))
    [before] = grpc_client.cluster_status().replicas
    body = {"model": model, "prompt": "Count:", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{base_url}/v1/completions", json=body, timeout=(5, 0.3))  # gives up (and closes) seconds before its last token
    wait_until(lambda: pool_is_idle(grpc_client))
    [after] = grpc_client.cluster_status().replicas
    assert after.num_aborted_requests == before.num_aborted_requests + 1


# --- KServe v2 ---------------------------------------------------------------------------------

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
    # Still serving: greedy and past EOS, so the answer is never empty (a sampled first token may be EOS).
    assert text_of(client.infer(model, llm_inputs(grpcclient, "still", False, {"max_tokens": 4, "temperature": 0, "ignore_eos": True}, exclude_input=True)))


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
