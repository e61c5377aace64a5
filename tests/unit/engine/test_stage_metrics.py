"""Per-stage metrics of a replica, from its ranks' fields as the last status probe left them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from engine.metrics import PipelineStageCollector

LABELS = {"replica": "decode-0", "pool": "decode"}


def test_each_stage_exports_up_busy_seconds_layers_and_bytes():
    ranks = [
        dict(rank=0, alive=True, stage=0, layer_start=0, layer_end=16, busy_s=1.5, param_bytes=10, kv_bytes=100),
        dict(rank=1, alive=True, stage=0, layer_start=0, layer_end=16, busy_s=2.5, param_bytes=10, kv_bytes=100),
        dict(rank=2, alive=False, stage=1),  # a rank that stopped answering before it ever reported
    ]
    registry = CollectorRegistry()
    registry.register(PipelineStageCollector(lambda: ranks, LABELS))
    text = generate_latest(registry).decode()
    for sample in (
        'splitserve_pp_stage_up{pool="decode",replica="decode-0",stage="0"} 1.0',
        'splitserve_pp_stage_up{pool="decode",replica="decode-0",stage="1"} 0.0',
        'splitserve_pp_stage_busy_seconds_total{pool="decode",replica="decode-0",stage="0"} 2.5',
        'splitserve_pp_stage_layers{pool="decode",replica="decode-0",stage="0"} 16.0',
        'splitserve_pp_stage_parameter_bytes{pool="decode",replica="decode-0",stage="0"} 20.0',
        'splitserve_pp_stage_kv_bytes{pool="decode",replica="decode-0",stage="0"} 200.0',
        'splitserve_pp_stage_kv_bytes{pool="decode",replica="decode-0",stage="1"} 0.0',
    ):
        assert sample in text.splitlines(), sample
