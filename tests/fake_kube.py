"""FakeKubeAPIServer: enough of the Kubernetes API, over real HTTP, for the real ``kubernetes`` client.

No API server can run here, so this one stands in for it. It serves the KubeRay RayCluster
custom object and the pod list the Kubernetes connector reads, with the semantics the connector
relies on:

- ``GET``/``PATCH``/``PUT`` of ``/apis/ray.io/v1/namespaces/{ns}/rayclusters/{name}`` and
  ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` (equality selectors);
- every write bumps ``metadata.resourceVersion`` (one counter for the whole store, as etcd does)
  and ``metadata.generation`` when the spec changed; writes never touch ``status`` (the CRD has a
  status subresource);
- ``PATCH`` by Content-Type: ``application/json-patch+json`` (RFC 6902: add, remove, replace,
  test; a failed ``test`` is 422), ``application/merge-patch+json`` (RFC 7386), and 415 for
  strategic merge and apply patches, which custom resources do not support;
- optimistic concurrency: a written object whose resourceVersion differs from the stored one is
  409 Conflict; a ``PUT`` without one is 422;
- errors are ``Status`` objects with the apiserver's messages;
- faults: ``concurrent_writes(n, mutate)`` changes the object as another writer would just before
  each of the next ``n`` writes arrive; ``refuse(verb, code)`` answers every request of that verb
  with ``code``; ``hold_requests()`` keeps requests waiting until released.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

RAYCLUSTER_PREFIX = "/apis/ray.io/v1/namespaces/"
POD_PREFIX = "/api/v1/namespaces/"
REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
    503: "ServiceUnavailable",
}
HOLD_TIMEOUT_S = 10.0
SHUTDOWN_POLL_S = 0.01


@dataclass(frozen=True)
class FakeRequest:
    """One request as the fake answered it."""

    verb: str
    """Kubernetes verb: get, list, patch or update."""
    path: str
    content_type: str
    code: int


class ApiError(Exception):
    def __init__(self, code: int, message: str, name: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.kind = kind


@dataclass
class _Hold:
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class FakeKubeAPIServer:
    """A Kubernetes API server fake on 127.0.0.1; use as a context manager, talk to ``url``."""

    def __init__(self, user: str = "system:serviceaccount:serving:splitserve-planner") -> None:
        self.user = user
        self.requests: list[FakeRequest] = []
        self._rayclusters: dict[tuple[str, str], dict] = {}
        self._pods: dict[str, list[dict]] = {}
        self._resource_versions = itertools.count(1000)
        self._lock = threading.Lock()
        self._concurrent_writes: list[Callable[[dict], None]] = []
        self._refusals: dict[str, int] = {}
        self._hold: _Hold | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S}, name="fake-kube", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeKubeAPIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._hold is not None:
            self._hold.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add_raycluster(self, raycluster: dict) -> None:
        meta = raycluster["metadata"]
        stored = copy.deepcopy(raycluster)
        stored["metadata"].update(resourceVersion=self._next_resource_version(), generation=1)
        with self._lock:
            self._rayclusters[(meta["namespace"], meta["name"])] = stored

    def raycluster(self, namespace: str, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._rayclusters[(namespace, name)])

    def add_pod(self, pod: dict) -> None:
        with self._lock:
            self._pods.setdefault(pod["metadata"]["namespace"], []).append(copy.deepcopy(pod))

    def concurrent_writes(self, num_writes: int, mutate: Callable[[dict], None]) -> None:
        """Before each of the next ``num_writes`` writes to a RayCluster is handled, ``mutate``
        changes the stored object and its resourceVersion moves on, as another writer's would."""
        with self._lock:
            self._concurrent_writes.extend([mutate] * num_writes)

    def refuse(self, verb: str, code: int) -> None:
        """Answer every later request of ``verb`` (get, list, patch, update) with ``code``."""
        with self._lock:
            self._refusals[verb] = code

    @contextlib.contextmanager
    def hold_requests(self) -> Iterator[_Hold]:
        """Requests wait inside the server until ``release`` is set (or HOLD_TIMEOUT_S passes);
        ``arrived`` is set when the first one is waiting."""
        hold = _Hold()
        self._hold = hold
        try:
            yield hold
        finally:
            hold.release.set()
            self._hold = None

    def verbs(self) -> list[tuple[str, int]]:
        return [(r.verb, r.code) for r in self.requests]

    def _next_resource_version(self) -> str:
        return str(next(self._resource_versions))

    def handle(self, method: str, target: str, content_type: str, body: bytes) -> tuple[int, dict]:
        split = urlsplit(target)
        verb = _verb(method, split.path)
        hold = self._hold
        if hold is not None:
            hold.arrived.set()
            hold.release.wait(HOLD_TIMEOUT_S)
        try:
            code, answer = 200, self._dispatch(verb, split.path, parse_qs(split.query), content_type, body)
        except ApiError as e:
            code, answer = e.code, _status(e.code, str(e), e.name, e.kind)
        with self._lock:
            self.requests.append(FakeRequest(verb, split.path, content_type, code))
        return code, answer

    def _dispatch(self, verb: str, path: str, query: dict, content_type: str, body: bytes) -> dict:
        parts = path.strip("/").split("/")
        if path.startswith(RAYCLUSTER_PREFIX) and len(parts) == 7 and parts[5] == "rayclusters":
            namespace, name = parts[4], parts[6]
            self._check_allowed(verb, "rayclusters", "ray.io", namespace, name)
            if verb == "get":
                return self._get(namespace, name)
            payload = json.loads(body) if body else None
            return self._write(verb, namespace, name, content_type, payload)
        if path.startswith(POD_PREFIX) and len(parts) == 5 and parts[4] == "pods" and verb == "list":
            namespace = parts[3]
            self._check_allowed(verb, "pods", "", namespace, "")
            return self._list_pods(namespace, query.get("labelSelector", [""])[0])
        raise ApiError(404, "the server could not find the requested resource")

    def _check_allowed(self, verb: str, resource: str, group: str, namespace: str, name: str) -> None:
        code = self._refusals.get(verb)
        if code is None:
            return
        qualified = f"{resource}.{group}" if group else resource
        if code == 403:
            target = f'{qualified} "{name}"' if name else qualified
            raise ApiError(
                403,
                f'{target} is forbidden: User "{self.user}" cannot {verb} resource "{resource}" '
                f'in API group "{group}" in the namespace "{namespace}"',
                name,
                resource,
            )
        raise ApiError(code, f"the fake was told to answer {verb} with {code}")

    def _get(self, namespace: str, name: str) -> dict:
        with self._lock:
            stored = self._rayclusters.get((namespace, name))
            if stored is None:
                raise ApiError(404, f'rayclusters.ray.io "{name}" not found', name, "rayclusters")
            return copy.deepcopy(stored)

    def _write(self, verb: str, namespace: str, name: str, content_type: str, payload) -> dict:
        with self._lock:
            stored = self._rayclusters.get((namespace, name))
            if stored is None:
                raise ApiError(404, f'rayclusters.ray.io "{name}" not found', name, "rayclusters")
            if self._concurrent_writes:
                self._concurrent_writes.pop(0)(stored)
                stored["metadata"]["resourceVersion"] = self._next_resource_version()
                stored["metadata"]["generation"] += 1
            if verb == "patch":
                written = _apply_patch(copy.deepcopy(stored), content_type, payload)
            else:
                written = copy.deepcopy(payload)
                if not written.get("metadata", {}).get("resourceVersion"):
                    raise ApiError(
                        422,
                        f'RayCluster.ray.io "{name}" is invalid: metadata.resourceVersion: '
                        "Invalid value: 0x0: must be specified for an update",
                        name,
                        "RayCluster",
                    )
            if written["metadata"].get("resourceVersion") != stored["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on rayclusters.ray.io "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    name,
                    "rayclusters",
                )
            written["status"] = stored.get("status")
            written["metadata"]["resourceVersion"] = self._next_resource_version()
            spec_changed = written.get("spec") != stored.get("spec")
            written["metadata"]["generation"] = stored["metadata"]["generation"] + int(spec_changed)
            self._rayclusters[(namespace, name)] = written
            return copy.deepcopy(written)

    def _list_pods(self, namespace: str, selector: str) -> dict:
        with self._lock:
            pods = [p for p in self._pods.get(namespace, []) if _selected(p, selector)]
            return {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(next(self._resource_versions))},
                "items": copy.deepcopy(pods),
            }


def _verb(method: str, path: str) -> str:
    if method == "GET":
        return "list" if path.rstrip("/").endswith("/pods") else "get"
    return {"PATCH": "patch", "PUT": "update"}.get(method, method.lower())


def _status(code: int, message: str, name: str, kind: str) -> dict:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": REASONS.get(code, "Unknown"),
        "code": code,
    }
    if name or kind:
        status["details"] = {"name": name, "group": "ray.io", "kind": kind}
    return status


def _selected(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


def _apply_patch(target: dict, content_type: str, payload) -> dict:
    media_type = content_type.split(";")[0].strip()
    if media_type == "application/json-patch+json":
        if not isinstance(payload, list):
            raise ApiError(400, "json patch must be a list of operations")
        for op in payload:
            target = _apply_json_patch_op(target, op)
        return target
    if media_type == "application/merge-patch+json":
        return _merge(target, payload)
    raise ApiError(
        415,
        f'the body of the request was in an unknown format - accepted media types include: '
        f"application/json-patch+json, application/merge-patch+json (got {media_type!r})",
    )


def _merge(target, patch):
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge(merged.get(key), value)
    return merged


def _apply_json_patch_op(doc: dict, op: dict) -> dict:
    tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
    parent = doc
    for token in tokens[:-1]:
        parent = _child(parent, token, op)
    last = tokens[-1]
    kind = op["op"]
    if kind == "test":
        if _child(parent, last, op) != op["value"]:
            raise ApiError(422, f"the server rejected our request due to an error in our request: "
                                f"testing value {op['path']} failed")
    elif kind == "replace":
        _child(parent, last, op)
        parent[_key(parent, last, op)] = op["value"]
    elif kind == "add":
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else _key(parent, last, op), op["value"])
        else:
            parent[last] = op["value"]
    elif kind == "remove":
        _child(parent, last, op)
        del parent[_key(parent, last, op)]
    else:
        raise ApiError(400, f"the fake does not implement json patch op {kind!r}")
    return doc


def _key(parent, token: str, op: dict):
    if isinstance(parent, list):
        if not token.isdigit():
            raise ApiError(422, f"{op['op']} operation does not apply: doc is missing path: {op['path']}")
        return int(token)
    return token


def _child(parent, token: str, op: dict):
    key = _key(parent, token, op)
    try:
        return parent[key]
    except (KeyError, IndexError, TypeError):
        raise ApiError(422, f"{op['op']} operation does not apply: doc is missing path: {op['path']}") from None


def _handler_for(fake: FakeKubeAPIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            code, answer = fake.handle(self.command, self.path, self.headers.get("Content-Type", ""), body)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = _serve

        def log_message(self, format: str, *args) -> None:
            pass

    return Handler
