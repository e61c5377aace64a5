"""Prometheus finds every metrics endpoint: through one ServiceMonitor when the operator's CRDs
exist (values say so), through prometheus.io/scrape annotations otherwise."""

from __future__ import annotations

from tests.unit.deploy.chart import container, find, render, worker_group

METRICS_SERVICES = ["splitserve-router", "splitserve-controller-metrics", "splitserve-prefill-metrics",
                    "splitserve-decode-metrics", "splitserve-planner-metrics"]


def _metrics_services(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "Service" and o["metadata"]["labels"].get("splitserve.io/metrics") == "true"]


def test_annotations_without_the_operator(example_objects):
    objects = example_objects["values-cpu-dev"]
    assert not [o for o in objects if o["kind"] == "ServiceMonitor"]
    services = _metrics_services(objects)
    assert sorted(s["metadata"]["name"] for s in services) == sorted(METRICS_SERVICES)
    for service in services:
        port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["metrics"]
        assert service["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def test_one_servicemonitor_with_the_operator(example_objects):
    objects = example_objects["values-gpu-llama-8b"]
    monitor = find(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [render.NAMESPACE]}
    selected = [s for s in objects if s["kind"] == "Service"
                and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(METRICS_SERVICES)
    for service in selected:
        assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {})
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}


def test_metrics_services_reach_the_ports_the_processes_listen_on(example_objects):
    """Each Service's target port is a named container port, and the head's flags bind there."""
    objects = example_objects["values-cpu-dev"]
    raycluster = find(objects, "RayCluster")
    head = container(raycluster["spec"]["headGroupSpec"]["template"])
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    args = head["args"]
    router = container(worker_group(raycluster, "router")["template"])
    router_args = router["args"]
    assert {p["name"]: p["containerPort"] for p in router["ports"]}["metrics"] == int(router_args[router_args.index("--metrics-port") + 1])
    assert head_ports["ctrl-metrics"] == int(args[args.index("--controller-metrics-port") + 1])
    for pool, flag in (("prefill", "--prefill-metrics-port"), ("decode", "--worker-metrics-port")):
        worker = container(worker_group(raycluster, pool)["template"])
        assert {p["name"]: p["containerPort"] for p in worker["ports"]}["metrics"] == int(args[args.index(flag) + 1])
        service = find(objects, "Service", f"splitserve-{pool}-metrics")
        assert service["spec"]["selector"] == {"ray.io/cluster": "splitserve", "ray.io/group": pool}
        assert service["spec"]["clusterIP"] == "None"
