"""A router that dies mid-stream on a real cluster (three router replicas, real Ray, real gRPC):
a client holding several routers' addresses resumes each cut answer through another router with
the tokens it received, and the answer completes token-identical to an undisturbed run: greedy,
seeded, and sampled without a seed (the seed the router chose and reported). The OpenAI HTTP API
takes the same resume."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests

from engine.config import EngineConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.integration.test_generate_api import collect
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = dict(max_tokens=400, ignore_eos=True)
PARAMS = {
    "greedy": dict(temperature=0, **LONG),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=77, **LONG),
    "unseeded": dict(temperature=0.9, top_k=50, **LONG),
}
NUM_READ = 3
"""Responses each stream has read when its router is killed."""


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=8, max_model_len=512)
    config = ClusterConfig(engine=engine, router=RouterConfig(port=0, http_port=0, worker_refresh_interval_s=0.25), num_routers=3)
    with running_cluster(config) as c:
        yield c


def addresses(cluster) -> list[str]:
    return [s.grpc_address for s in cluster.router_statuses]


def undisturbed(client: SplitServeClient, prompt: list[int], params: dict, seed: int | None):
    """The answer with nothing killed; an unseeded one run with the seed its cut run reported."""
    if seed is not None and "seed" not in params:
        params = dict(params, seed=seed)
    return collect(client.generate(prompt, **params))


def cut_streams(cluster, order: list[int], kill) -> None:
    """Start one stream per sampling kind on router ``order[0]``, kill it once each stream has
    read NUM_READ responses, and check every answer completes on ``order[1]`` as undisturbed."""
    prompts = dict(zip(PARAMS, random_prompts([40, 33, 27], seed=52)))
    routers = [addresses(cluster)[i] for i in order]
    clients = {kind: SplitServeClient(routers) for kind in PARAMS}  # a client's calls take turns: each one's first goes to routers[0]
    with SplitServeClient(routers[1]) as reference:
        streams = {kind: clients[kind].generate(prompts[kind], **params) for kind, params in PARAMS.items()}
        read = {kind: [next(stream) for _ in range(NUM_READ)] for kind, stream in streams.items()}
        assert {s.address for s in streams.values()} == {routers[0]}
        kill(cluster.routers[order[0]])
        with ThreadPoolExecutor(len(streams)) as pool:
            rest = dict(zip(streams, pool.map(lambda s: collect(s), streams.values())))
        for kind, params in PARAMS.items():
            ids, text, last = collect(read[kind])[0] + rest[kind][0], collect(read[kind])[1] + rest[kind][1], rest[kind][2]
            seed = read[kind][0].seed if read[kind][0].HasField("seed") else None
            expected_ids, expected_text, expected_last = undisturbed(reference, prompts[kind], params, seed)
            assert (streams[kind].num_resumes, streams[kind].address) == (1, routers[1]), kind
            assert ids == expected_ids, kind
            assert text == expected_text, kind
            assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
                expected_last.finish_reason, expected_last.usage.prompt_tokens, expected_last.usage.completion_tokens), kind
            assert {r.request_id for r in read[kind]} | {last.request_id} == {read[kind][0].request_id}, kind
        assert (read["greedy"][0].HasField("seed"), read["seeded"][0].seed) == (False, 77)
        assert read["unseeded"][0].HasField("seed")
    for client in clients.values():
        client.close()


def test_streams_cut_by_a_router_killed_through_ray_complete_on_another(cluster):
    cut_streams(cluster, [0, 1], ray.kill)


def test_streams_cut_by_a_router_killed_with_sigkill_complete_on_another(cluster):
    def sigkill(router) -> None:
        pid = ray.get(router.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z")

    cut_streams(cluster, [2, 1], sigkill)


def sse_chunks(url: str, body: dict, num_token_ids: int | None = None) -> list[dict]:
    """The chunks of a streamed completion; with ``num_token_ids``, the stream is cut (its
    connection closed) once that many token ids have arrived."""
    chunks, num_ids = [], 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunks.append(json.loads(line[len(b"data: "):]))
            num_ids += len(chunks[-1].get("resume", {}).get("token_ids", []))
            if num_token_ids is not None and num_ids >= num_token_ids:
                break
    return chunks


def ids_and_text(chunks: list[dict]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.get("resume", {}).get("token_ids", [])], "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_an_http_stream_cut_mid_answer_resumes_through_the_openai_api(cluster):
    """The stream is cut by closing its connection (what a client sees when its router dies); the
    resume goes to a router through /v1/completions with what the cut chunks carried."""
    url = cluster.router_statuses[1].http_url
    with SplitServeClient(addresses(cluster)[1]) as client:
        model = client.list_models()[0].id
    [prompt] = random_prompts([30], seed=53)
    body = dict(model=model, prompt=prompt, max_tokens=60, temperature=0.9, ignore_eos=True, stream=True, return_resume=True)
    cut = sse_chunks(url, body, num_token_ids=5)
    seed = cut[0]["resume"]["seed"]
    cut_ids, cut_text = ids_and_text(cut)
    resume = {"token_ids": cut_ids, "tag": cut[-1]["resume"]["tag"]}
    rest_ids, rest_text = ids_and_text(sse_chunks(url, dict(body, seed=seed, resume=resume)))
    full_ids, full_text = ids_and_text(sse_chunks(url, dict(body, seed=seed)))
    assert len(full_ids) == 60
    assert (cut_ids + rest_ids, cut_text + rest_text) == (full_ids, full_text)

    altered = dict(resume, token_ids=[*cut_ids[:-1], (cut_ids[-1] + 1) % 100])
    refused = requests.post(f"{url}/v1/completions", json=dict(body, seed=seed, resume=altered), timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "resume.tag"
    assert refused.json()["error"]["message"].startswith(f"resume.tag: does not match the request and its {len(cut_ids)} token ids")
