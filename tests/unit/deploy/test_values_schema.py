"""Values that cannot work are refused before any template runs: Helm validates them against
values.schema.json on install, upgrade and template (render() does the same), and the message
names the key. Cross-field checks the schema cannot state fail the render with a sentence."""

from __future__ import annotations

import copy

import pytest
from helm_python.errors import HelmRenderError, HelmValuesError

from tests.unit.deploy.chart import example_values, render


def _with(example: str, path: str, value) -> dict:
    values = copy.deepcopy(example_values(example))
    *parents, leaf = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return values


def _refusal(values: dict, error=HelmValuesError) -> str:
    with pytest.raises(error) as raised:
        render.render(values)
    return str(raised.value)


def test_defaults_without_a_model_are_refused():
    message = _refusal({})
    assert "at '/model': missing property 'name'" in message


def test_an_empty_model_name_is_refused():
    message = _refusal(_with("values-gpu-llama-8b", "model.name", ""))
    assert "at '/model/name': minLength: got 0, want 1" in message


def test_a_wrong_type_is_refused():
    message = _refusal(_with("values-gpu-llama-8b", "prefill.tp", "2"))
    assert "at '/prefill/tp': got string, want integer" in message


def test_an_unknown_key_is_refused():
    message = _refusal(_with("values-gpu-llama-8b", "decode.gpus", 2))
    assert "at '/decode': additional properties 'gpus' not allowed" in message


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_min_replicas_above_max_replicas_is_refused(pool):
    values = _with("values-gpu-llama-8b", f"{pool}.minReplicas", 3)
    values[pool].update(maxReplicas=2, replicas=3)
    message = _refusal(values)
    assert f"at '/{pool}/maxReplicas': minimum: got 2, want 3" in message


def test_min_equal_to_max_is_accepted():
    values = _with("values-gpu-llama-8b", "decode.minReplicas", 2)
    values["decode"].update(maxReplicas=2, replicas=2)
    assert render.render(values)


def test_tp_that_does_not_divide_the_nodes_gpus_is_refused():
    message = _refusal(_with("values-gpu-70b-tp", "prefill.tp", 3))
    assert "at '/prefill/tp': value must be one of 1, 2, 4, 8" in message


def test_tp_larger_than_the_nodes_gpus_is_refused():
    message = _refusal(_with("values-gpu-70b-tp", "decode.tp", 16))
    assert "at '/decode/tp': value must be one of 1, 2, 4, 8" in message


def test_ep_that_does_not_divide_the_nodes_gpus_is_refused():
    values = _with("values-moe-ep", "gpusPerNode", 6)
    message = _refusal(values)
    assert "at '/decode/ep': value must be one of 1, 2, 3, 6" in message


def test_tp_and_ep_together_are_refused():
    message = _refusal(_with("values-moe-ep", "decode.tp", 2))
    assert "at '/decode/ep': value must be 1" in message


def test_pipeline_stages_are_checked():
    assert "at '/prefill/pp': minimum: got 0, want 1" in _refusal(_with("values-gpu-70b-tp", "prefill.pp", 0))
    assert "at '/decode/ep': value must be 1" in _refusal(_with("values-moe-ep", "decode.pp", 2))  # the engine refuses PP with EP
    six = _with("values-gpu-70b-tp", "prefill.tp", 2)
    six["prefill"]["pp"] = 3
    message = _refusal(six, HelmRenderError)
    assert "prefill.tp x prefill.pp is 6 GPUs a pod (every stage of a replica on its pod), which gpusPerNode (8) is not a multiple of" in message
    four = _with("values-gpu-70b-tp", "prefill.tp", 2)
    four["prefill"]["pp"] = 2  # 4 GPUs a pod on 8-GPU nodes, but the example keeps both KV tiers on
    message = _refusal(four, HelmRenderError)
    assert "prefill.pp or decode.pp above 1 with a CPU or Redis KV tier" in message
    four["engine"]["cpuKvCacheBytes"] = 0
    assert "prefill.pp or decode.pp above 1 with a CPU or Redis KV tier" in _refusal(four, HelmRenderError)  # Redis still on
    four["redis"] = {**four["redis"], "enabled": False, "externalUrl": ""}
    render.render(four)


def test_decode_cannot_scale_to_zero():
    message = _refusal(_with("values-gpu-llama-8b", "decode.minReplicas", 0))
    assert "at '/decode/minReplicas': minimum: got 0, want 1" in message


def test_tls_without_a_secret_is_refused():
    message = _refusal(_with("values-moe-ep", "tls.secretName", ""))
    assert "at '/tls/secretName': minLength: got 0, want 1" in message


def test_unknown_weights_or_speculation_are_refused():
    assert "at '/engine/weights'" in _refusal(_with("values-cpu-dev", "engine.weights", "q4_k"))
    assert "at '/engine/speculative'" in _refusal(_with("values-cpu-dev", "engine.speculative", "medusa"))


def test_cluster_tls_without_a_ca_secret_is_refused():
    message = _refusal(_with("values-moe-ep", "clusterTLS.caSecretName", ""))
    assert "at '/clusterTLS/caSecretName': minLength: got 0, want 1" in message


def test_replicas_outside_the_bounds_fail_with_a_sentence():
    message = _refusal(_with("values-gpu-llama-8b", "prefill.replicas", 5), HelmRenderError)
    assert "prefill.replicas (5) must lie within prefill.minReplicas (0) and prefill.maxReplicas (4)" in message


@pytest.mark.parametrize("off", [None, "tls", "auth"])
def test_planner_with_tls_or_token_is_no_longer_refused(off):
    values = _with("values-moe-ep", "planner.enabled", True)
    if off:
        values[off]["enabled"] = False
    planners = [o for o in render.render_objects(values) if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-planner")]
    assert [p["metadata"]["name"] for p in planners] == ["splitserve-planner"]


def test_a_ca_key_that_is_no_file_name_is_refused():
    message = _refusal(_with("values-moe-ep", "tls.caKey", "../ca.crt"))
    assert "at '/tls/caKey': '../ca.crt' does not match pattern '^[-._a-zA-Z0-9]+$'" in message


def test_the_sdk_schema_check_agrees_with_render():
    """helm-python-sdk's own validate_schema (what `helm lint` runs) refuses the same values."""
    from helm_python.chart import Chart

    with Chart.load(render.CHART_DIR) as chart:
        with pytest.raises(HelmValuesError, match=r"at '/prefill/tp': value must be one of 1, 2, 4, 8"):
            chart.validate_schema(_with("values-gpu-70b-tp", "prefill.tp", 3))
        chart.validate_schema(example_values("values-gpu-70b-tp"))
