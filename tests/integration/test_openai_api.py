"""The OpenAI-compatible HTTP API on a real local cluster, driven by the real ``openai`` SDK
(sync and async, streaming and not) and by raw HTTP where the SDK would refuse the input first."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests

from tests.integration.conftest import wait_until
from tests.integration.http_cluster import cluster, grpc_client, http_address, model  # noqa: F401 (fixtures)
from tests.unit.engine.helpers import random_prompts

pytestmark = pytest.mark.integration

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
