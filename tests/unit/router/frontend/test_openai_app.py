"""The HTTP app's edges without Ray: bearer-token auth, error shapes and statuses (401, 404,
429, 503) of the OpenAI and KServe paths, health and metrics. Requests go straight into the
ASGI app over its real interface (scope, receive, send); the GenerationService behind it is the
real one, with a worker directory filled by hand and no worker behind it."""

import asyncio
import json

import pytest

from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.frontend.apis.app import build_app, max_body_bytes
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService
from router.routing.policy import make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.worker_calls import WorkerChannels
from router.routing.workers import WorkerDirectory

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def make_app(*, replicas: bool = True, token: str | None = None, max_inflight: int = 8):
    directory = WorkerDirectory()
    if replicas:
        status = pb.ReplicaStatus(replica_id="decode-0", pool="decode", healthy=True, num_kv_blocks=10, num_free_kv_blocks=10)
        directory.update([(status, pb.ModelInfo(id="m", max_model_len=64), object())])
    metrics = RouterMetrics("r0")
    config = RouterConfig(max_inflight_requests=max_inflight)
    service = GenerationService(config, directory, metrics, make_policy("splitserve", PrefixIndex()), WorkerChannels("r0"))
    return build_app(service, metrics, token), service, metrics


def call(app, method: str, path: str, body: object = None, headers: dict[str, str] = {}) -> tuple[int, object]:
    """One request through the ASGI interface; the client never disconnects."""

    async def run():
        raw = json.dumps(body).encode() if body is not None else b""
        delivered, sent = False, []

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("test", 1),
            "headers": [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **headers}.items()],
        }
        await app(scope, receive, send)
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], json.loads(data) if data.startswith((b"{", b"[")) else data

    return asyncio.run(run())


def test_a_missing_or_wrong_token_is_401_in_each_protocols_shape():
    app, _, _ = make_app(token="s3cret")
    assert call(app, "POST", "/v1/chat/completions", CHAT) == (401, {"error": {
        "message": "missing bearer token", "type": "authentication_error", "param": None, "code": "invalid_api_key"}})
    status, body = call(app, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert (status, body["error"]["message"]) == (401, "missing or invalid bearer token")
    assert call(app, "GET", "/v2/models/m", headers={"Authorization": "Bearer nope"}) == (401, {"error": "missing or invalid bearer token"})
    assert call(app, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
    assert call(app, "GET", "/health")[0] == 200 and call(app, "GET", "/v2/health/ready")[0] == 200  # probes carry no token


def test_a_full_router_is_429():
    app, service, _ = make_app(max_inflight=1)
    service.num_inflight = 1  # one call already in flight
    status, body = call(app, "POST", "/v1/chat/completions", CHAT)
    assert (status, body["error"]["type"], body["error"]["code"]) == (429, "rate_limit_error", "resource_exhausted")
    assert body["error"]["message"] == "router has 1 calls in flight"
    status, body = call(app, "POST", "/v2/models/m/generate", {"text_input": "hi"})
    assert (status, body) == (429, {"error": "router has 1 calls in flight"})


def test_no_live_replica_is_503_everywhere():
    app, _, _ = make_app(replicas=False)
    status, body = call(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi"})
    assert (status, body["error"]["type"]) == (503, "service_unavailable_error")
    assert call(app, "GET", "/health")[0] == 503
    assert call(app, "GET", "/v2/health/ready")[0] == 503
    assert call(app, "GET", "/v2/health/live")[0] == 200
    assert call(app, "POST", "/v2/models/m/infer", {"inputs": []}) == (404, {"error": "model: 'm' is not served here (served: none)"})


def test_unknown_routes_and_models_are_404():
    app, _, _ = make_app()
    status, body = call(app, "GET", "/v1/nothing")
    assert (status, body["error"]["message"]) == (404, "GET /v1/nothing: Not Found")
    status, body = call(app, "GET", "/v1/models/x")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert call(app, "GET", "/v1/models/m")[1]["id"] == "m"
    assert call(app, "GET", "/v2/models/x") == (404, {"error": "model: 'x' is not served here (served: m)"})
    assert call(app, "GET", "/v2/models/m/ready")[0] == 200 and call(app, "GET", "/v2/models/x/ready")[0] == 404


@pytest.mark.parametrize("path, body, message", [
    ("/v2/models/m/infer", {"inputs": [{"name": "text_input", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, "text_input: datatype must be BYTES, got FP32"),
    ("/v2/models/m/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 2], "data": [["a", "b"]]}]}, "text_input: shape [1, 2] must hold exactly one element"),
    ("/v2/models/m/infer", {"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}, "prompt: unknown input"),
    ("/v2/models/m/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}]}, "text_input: data is required"),
    ("/v2/models/m/infer", {"outputs": []}, "inputs: required: a list of input tensors"),
    ("/v2/models/m/generate", {"text_input": "hi", "stream": True}, "stream: a streamed request needs generate_stream"),
    ("/v2/models/m/generate", {"text_input": "hi", "parameters": {"max_tokens": "many"}}, "parameters.max_tokens: must be an integer, got 'many'"),
    ("/v2/models/m/generate", {"text_input": "hi", "temperature": 0}, "temperature: unknown input"),
])
def test_bad_kserve_requests_are_400_naming_the_field(path, body, message):
    app, _, _ = make_app()
    status, got = call(app, "POST", path, body)
    assert status == 400 and got["error"].startswith(message), got


def test_http_requests_are_counted_by_route_template():
    app, _, metrics = make_app()
    call(app, "GET", "/v2/models/m")
    call(app, "GET", "/v2/models/x")
    labels = {"router": "r0", "method": "GET", "route": "/v2/models/{model:path}"}
    assert metrics.registry.get_sample_value("splitserve_http_requests_total", {**labels, "status": "200"}) == 1
    assert metrics.registry.get_sample_value("splitserve_http_requests_total", {**labels, "status": "404"}) == 1


def test_http_port_is_a_splitserve_up_flag_and_off_by_default():
    import argparse

    from cli.args import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, RouterConfig, skip=("tls", "cluster_tls"))
    assert dataclass_from_args(RouterConfig, parser.parse_args(["--http-port", "8000"]), tls=None, cluster_tls=None).http_port == 8000
    assert dataclass_from_args(RouterConfig, parser.parse_args([]), tls=None, cluster_tls=None).http_port is None
    with pytest.raises(ValueError, match="http_port: 70000 is not a port"):
        RouterConfig(http_port=70000)


def test_a_body_past_the_limit_is_413_before_it_is_read():
    app, service, _ = make_app()
    limit = max_body_bytes(service.config)
    status, body = call(app, "POST", "/v1/completions", headers={"Content-Length": str(limit + 1)})
    assert (status, body["error"]["message"]) == (413, f"request body: {limit + 1} bytes exceed the limit of {limit}")
