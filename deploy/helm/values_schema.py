"""Builds the chart's values.schema.json.

Helm checks values against the schema on install, upgrade, template and lint, before any
template runs, so a deployment that cannot work stops there with the offending key named.
JSON Schema cannot compare two fields or test divisibility of one field by another, so the two
cross-field rules are spelled out value by value:

- ``minReplicas <= maxReplicas``: for each k in 1..MAX_REPLICAS, ``minReplicas == k`` implies
  ``maxReplicas >= k`` (error: "at '/prefill/maxReplicas': minimum: got 1, want 3");
- a pool's TP/EP size divides ``gpusPerNode``: for each g in 1..MAX_GPUS_PER_NODE,
  ``gpusPerNode == g`` implies the size is one of g's divisors
  (error: "at '/prefill/tp': value must be one of 1, 2, 4, 8").

Run ``python deploy/helm/render.py`` (``make chart``) to rewrite the file; a test fails when the
committed file differs from what this module builds.
"""

from __future__ import annotations

from compact_json import dumps

MAX_REPLICAS = 128
"""The most pods a worker group may have (the bound of the min <= max rule)."""
MAX_GPUS_PER_NODE = 16
"""The most GPUs a node may report (the bound of the divisibility rule)."""
POOLS = ("prefill", "decode")


def _resources() -> dict:
    quantity = {"type": ["string", "integer", "number"]}
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {"requests": {"type": "object", "additionalProperties": quantity},
                       "limits": {"type": "object", "additionalProperties": quantity}},
    }


def _placement() -> dict:
    return {"nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": {"type": "object"}},
            "affinity": {"type": "object"}}


def _integer(minimum: int, maximum: int | None = None, description: str = "") -> dict:
    schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    if description:
        schema["description"] = description
    return schema


def _port() -> dict:
    return _integer(1, 65535)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _min_not_above_max() -> list[dict]:
    return [{"if": {"properties": {"minReplicas": {"const": k}}},
             "then": {"properties": {"maxReplicas": {"minimum": k}}}}
            for k in range(1, MAX_REPLICAS + 1)]


def _size_divides_gpus() -> list[dict]:
    rules = []
    for gpus in range(1, MAX_GPUS_PER_NODE + 1):
        divisors = {"enum": _divisors(gpus)}
        rules.append({
            "if": {"properties": {"gpusPerNode": {"const": gpus}}},
            "then": {"properties": {"prefill": {"properties": {"tp": divisors}},
                                    "decode": {"properties": {"tp": divisors, "ep": divisors}}}},
        })
    return rules


def _pool(pool: str) -> dict:
    properties = {
        "replicas": _integer(0, MAX_REPLICAS, "Pods (replicas) the group starts with."),
        "minReplicas": _integer(0 if pool == "prefill" else 1, MAX_REPLICAS),
        "maxReplicas": _integer(1, MAX_REPLICAS),
        "tp": _integer(1, MAX_GPUS_PER_NODE, "Tensor-parallel ranks per replica: GPUs per pod."),
        "pp": _integer(1, MAX_GPUS_PER_NODE, "Pipeline stages per replica, every one on the replica's pod: it requests tp x pp GPUs."),
        "cpus": _integer(1),
        "memory": {"type": "string", "minLength": 1},
        "shmSize": {"type": "string", "minLength": 1},
        "drainTimeoutS": _integer(1, description="Seconds a replica may drain after SIGTERM."),
        "metricsPort": _port(),
        **_placement(),
    }
    if pool == "decode":
        properties["ep"] = _integer(1, MAX_GPUS_PER_NODE, "Expert-parallel ranks per replica: GPUs per pod.")
    schema = {"type": "object", "additionalProperties": False, "properties": properties,
              "required": ["replicas", "minReplicas", "maxReplicas", "tp"],
              "allOf": [{"$ref": "#/$defs/minReplicasNotAboveMaxReplicas"}]}
    if pool == "decode":
        schema["allOf"].append({"if": {"properties": {"tp": {"minimum": 2}}},
                                "then": {"properties": {"ep": {"const": 1}}}})
        schema["allOf"].append({"if": {"properties": {"pp": {"minimum": 2}}, "required": ["pp"]},
                                "then": {"properties": {"ep": {"const": 1}}}})
    return schema


def _gcs_fault_tolerance() -> dict:
    string = {"type": "string"}
    secret_key = {"type": "string", "pattern": "^[-._a-zA-Z0-9]+$"}
    return {
        "type": "object", "additionalProperties": False,
        "properties": {
            "enabled": {"type": "boolean"},
            "redis": {"type": "object", "additionalProperties": False, "properties": {
                "enabled": {"type": "boolean"},
                "image": {"type": "object", "additionalProperties": False,
                          "properties": {"repository": {"type": "string", "minLength": 1},
                                         "tag": {"type": "string", "minLength": 1}}},
                "resources": _resources()}},
            "externalAddress": {"type": "string", "pattern": "^$|^(redis://|rediss://)?[^/:\\s]+:[0-9]+$",
                                "description": "host:port, redis://host:port or rediss://host:port."},
            "passwordSecret": {"type": "object", "additionalProperties": False,
                               "properties": {"name": string, "key": secret_key}},
            "tls": {"type": "object", "additionalProperties": False,
                    "properties": {"caSecretName": string, "caKey": secret_key}},
            "externalStorageNamespace": string,
            "reconnectTimeoutS": _integer(1, description="RAY_gcs_rpc_server_reconnect_timeout_s of worker and router pods."),
        },
    }


def build_schema() -> dict:
    """The whole values.schema.json as a dict."""
    string = {"type": "string"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "splitserve chart values",
        "type": "object",
        "additionalProperties": False,
        "required": ["image", "model", "gpusPerNode", "prefill", "decode"],
        "properties": {
            "fullnameOverride": {"type": "string", "maxLength": 40},
            "global": {"type": "object"},
            "image": {"type": "object", "additionalProperties": False, "required": ["repository", "tag"],
                      "properties": {"repository": {"type": "string", "minLength": 1},
                                     "tag": {"type": "string", "minLength": 1},
                                     "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}},
            "imagePullSecrets": {"type": "array", "items": {"type": "object"}},
            "rayVersion": {"type": "string", "minLength": 1},
            "gpusPerNode": _integer(0, MAX_GPUS_PER_NODE, "GPUs per worker node; 0 for CPU workers."),
            "model": {"type": "object", "additionalProperties": False, "required": ["name"],
                      "properties": {"name": {"type": "string", "minLength": 1,
                                              "description": "--model: a bundled model name or a checkpoint directory in the pods."},
                                     "pvc": {"type": "object", "additionalProperties": False,
                                             "properties": {"claimName": string,
                                                            "mountPath": {"type": "string", "pattern": "^/"}}}}},
            "engine": {"type": "object", "additionalProperties": False, "properties": {
                "dtype": {"enum": ["float32", "bfloat16"]},
                "weights": {"enum": ["native", "bf16", "fp32", "int8", "int4"]},
                "kvDtype": {"enum": ["fp32", "bf16", "fp8_e4m3"]},
                "speculative": {"enum": ["off", "ngram"]},
                "numSpeculativeTokens": {"type": "integer", "minimum": 1, "maximum": 16},
                "maxModelLen": {"type": ["integer", "null"], "minimum": 2},
                "kvCacheBytes": {"type": ["integer", "null"], "minimum": 1},
                "cpuKvCacheBytes": _integer(0),
                "extraArgs": {"type": "array", "items": string}}},
            "head": {"type": "object", "additionalProperties": False,
                     "properties": {"resources": _resources(), "shmSize": {"type": "string", "minLength": 1}, **_placement()}},
            "router": {"type": "object", "additionalProperties": False, "properties": {
                "replicas": _integer(1, MAX_REPLICAS, "Router pods (one router replica each)."),
                "cpus": _integer(1),
                "memory": {"type": "string", "minLength": 1},
                "shmSize": {"type": "string", "minLength": 1},
                "stopGraceS": _integer(0, description="Seconds in-flight calls may take to finish after SIGTERM."),
                "extraArgs": {"type": "array", "items": string},
                **_placement(),
                "grpcPort": _port(),
                "http": {"type": "object", "additionalProperties": False,
                         "properties": {"enabled": {"type": "boolean"}, "port": _port()}},
                "metricsPort": _port(),
                "service": {"type": "object", "additionalProperties": False,
                            "properties": {"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                           "annotations": {"type": "object", "additionalProperties": string}}}}},
            "controller": {"type": "object", "additionalProperties": False, "properties": {"metricsPort": _port()}},
            "prefill": _pool("prefill"),
            "decode": _pool("decode"),
            "planner": {"type": "object", "additionalProperties": False, "properties": {
                "enabled": {"type": "boolean"},
                "ttftSloS": {"type": "number", "exclusiveMinimum": 0},
                "itlSloS": {"type": "number", "exclusiveMinimum": 0},
                "intervalS": {"type": "number", "exclusiveMinimum": 0},
                "metricsPort": _port(),
                "dryRun": {"type": "boolean"},
                "extraArgs": {"type": "array", "items": string},
                "resources": _resources(),
                "nodeSelector": {"type": "object", "additionalProperties": string},
                "tolerations": {"type": "array", "items": {"type": "object"}}}},
            "redis": {"type": "object", "additionalProperties": False, "properties": {
                "enabled": {"type": "boolean"},
                "externalUrl": {"type": "string", "pattern": "^$|^(redis|rediss)://"},
                "ttlS": _integer(1),
                "image": {"type": "object", "additionalProperties": False,
                          "properties": {"repository": {"type": "string", "minLength": 1},
                                         "tag": {"type": "string", "minLength": 1}}},
                "persistence": {"type": "object", "additionalProperties": False,
                                "properties": {"size": {"type": "string", "minLength": 1}, "storageClassName": string}},
                "maxMemory": {"type": "string", "minLength": 1},
                "resources": _resources()}},
            "gcsFaultTolerance": _gcs_fault_tolerance(),
            "tls": {"type": "object", "additionalProperties": False,
                    "properties": {"enabled": {"type": "boolean"}, "secretName": string,
                                   "caKey": {"type": "string", "pattern": "^[-._a-zA-Z0-9]+$",
                                             "description": "Key of the Secret holding the CA the planner verifies the router with."}},
                    "if": {"properties": {"enabled": {"const": True}}},
                    "then": {"properties": {"secretName": {"minLength": 1}}}},
            "clusterTLS": {"type": "object", "additionalProperties": False,
                           "properties": {"enabled": {"type": "boolean"}, "caSecretName": string},
                           "if": {"properties": {"enabled": {"const": True}}},
                           "then": {"properties": {"caSecretName": {"minLength": 1}}}},
            "auth": {"type": "object", "additionalProperties": False,
                     "properties": {"enabled": {"type": "boolean"}, "secretName": string,
                                    "secretKey": {"type": "string", "minLength": 1}},
                     "if": {"properties": {"enabled": {"const": True}}},
                     "then": {"properties": {"secretName": {"minLength": 1}}}},
            "metrics": {"type": "object", "additionalProperties": False, "properties": {
                "serviceMonitor": {"type": "object", "additionalProperties": False, "properties": {
                    "enabled": {"type": "boolean"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "labels": {"type": "object", "additionalProperties": string}}}}},
            "grafana": {"type": "object", "additionalProperties": False, "properties": {
                "dashboard": {"type": "object", "additionalProperties": False, "properties": {
                    "enabled": {"type": "boolean"},
                    "labels": {"type": "object", "additionalProperties": string},
                    "namespace": string}}}},
        },
        "allOf": [{"$ref": "#/$defs/poolSizesDivideGpusPerNode"}],
        "$defs": {
            "minReplicasNotAboveMaxReplicas": {"allOf": _min_not_above_max()},
            "poolSizesDivideGpusPerNode": {"allOf": _size_divides_gpus()},
        },
    }


def schema_text() -> str:
    """The file's exact text."""
    return dumps(build_schema()) + "\n"
