"""Every rendered object is valid Kubernetes: built-in kinds against kubernetes-validate's
schemas (strict: unknown fields refused), the RayCluster and ServiceMonitor against the JSON
schemas in deploy/helm/schemas, and the RayCluster's pod templates as core/v1 PodTemplates."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate.utils as kv
import pytest

from tests.unit.deploy.chart import EXAMPLES, HELM_DIR, KUBERNETES_VERSION, find

CUSTOM_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): HELM_DIR / "schemas" / "raycluster.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): HELM_DIR / "schemas" / "servicemonitor.schema.json",
}


def _custom_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(CUSTOM_SCHEMAS[(api_version, kind)].read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM_SCHEMAS:
        _custom_validator(*key).validate(obj)
    else:
        kv.validate(obj, KUBERNETES_VERSION, strict=True)


def _pod_templates(raycluster: dict) -> list[tuple[str, dict]]:
    spec = raycluster["spec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, group["template"]) for name, group in groups]


def test_the_pinned_kubernetes_version_is_the_newest_shipped():
    newest = max(kv.all_versions(), key=lambda v: tuple(int(p) for p in v.split(".")))
    assert newest.startswith(KUBERNETES_VERSION + ".")


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_object_validates(example, example_objects):
    for obj in example_objects[example]:
        _validate(obj)


@pytest.mark.parametrize("example", EXAMPLES)
def test_raycluster_pod_templates_are_valid_pod_templates(example, example_objects):
    raycluster = find(example_objects[example], "RayCluster")
    for group, template in _pod_templates(raycluster):
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"x-{group}"}, "template": template},
                    KUBERNETES_VERSION, strict=True)


def test_every_kind_is_covered_by_a_schema(example_objects):
    kinds = {(o["apiVersion"], o["kind"]) for objects in example_objects.values() for o in objects}
    assert set(CUSTOM_SCHEMAS) <= kinds
    for api_version, kind in kinds - set(CUSTOM_SCHEMAS):
        try:  # a schema that refuses a bare object exists; SchemaNotFoundError would fail the test
            kv.validate({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}, KUBERNETES_VERSION)
        except kv.ValidationError:
            pass


def test_raycluster_schema_refuses_a_misspelt_field(example_objects):
    raycluster = copy.deepcopy(find(example_objects["values-cpu-dev"], "RayCluster"))
    raycluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="'maxReplica' was unexpected"):
        _validate(raycluster)


def test_raycluster_schema_refuses_a_non_string_ray_start_param(example_objects):
    raycluster = copy.deepcopy(find(example_objects["values-cpu-dev"], "RayCluster"))
    raycluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        _validate(raycluster)


def test_servicemonitor_schema_refuses_a_bad_interval(example_objects):
    monitor = copy.deepcopy(find(example_objects["values-gpu-llama-8b"], "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        _validate(monitor)


def test_kubernetes_validate_refuses_an_unknown_field(example_objects):
    service = copy.deepcopy(find(example_objects["values-cpu-dev"], "Service", "splitserve-router"))
    service["spec"]["port"] = 50051
    with pytest.raises(kv.ValidationError):
        _validate(service)
