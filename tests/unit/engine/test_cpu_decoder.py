"""A small step's decoder layers in one C call (engine.kernels._cpu_decoder) against the Python layers.

The fused path calls the very kernels the layers call, in the same float32 order; only SiLU's
exp differs (libm's in C, Sleef's in torch). With the Python MLP's SiLU computed through libm's
expf as well, the two paths must agree bit for bit: hidden states, logits and the K/V rows the
step leaves for the pool."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import numpy as np
import pytest
import torch

from engine.kernels import cpu_decoder
from engine.layers import mlp
from engine.models.decoder import DecoderModel
from tests.native import built_or_skip
from tests.unit.engine.helpers import GREEDY, make_engine, native_qmatmul, random_prompts, run_staggered  # noqa: F401 (a fixture)


@pytest.fixture
def native(native_qmatmul):
    """The fused-layers extension, with quantized weights built for the C matmul it calls (also on
    a CPU where the engine itself would not choose that kernel: only its scalar path runs there)."""
    return built_or_skip(cpu_decoder._native, "engine.kernels._cpu_decoder", "gcc, and the _qmatmul and _cpu_attention extensions",
                         "every step runs the Python layers")


@pytest.fixture
def libm_silu(monkeypatch):
    """The Python MLP with ``silu(g) = g / (1 + expf(-g))`` in float32 through libm, as the C side computes it."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]

    def forward(self, x, fused=False):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        g, u = gate.contiguous().numpy(), up.contiguous().numpy()
        e = np.array([libm.expf(-float(v)) for v in g.ravel()], dtype=np.float32).reshape(g.shape)
        return self.down_proj(torch.from_numpy(g / (np.float32(1) + e) * u))

    monkeypatch.setattr(mlp.GatedMLP, "forward", forward)


def _fused_checked_against_python(monkeypatch, model: DecoderModel) -> list[dict]:
    """Make every fused step also run the Python layers on copies and record both; the step goes on with the fused result."""
    seen = []
    fused_run = cpu_decoder.FusedLayers.run

    def run(self, hidden, batch):
        python_batch = dataclasses.replace(batch, new_k=batch.new_k.clone(), new_v=batch.new_v.clone())
        expected, residual = hidden.clone(), None
        for layer in model.layers:
            expected, residual = layer(expected, residual, python_batch)
        expected = residual + expected
        got = fused_run(self, hidden, batch)
        seen.append({
            "tokens": hidden.shape[0], "groups": len(batch.decode_groups), "chunks": [c.num_tokens for c in batch.prefill_chunks],
            "hidden": torch.equal(got, expected), "k": torch.equal(batch.new_k, python_batch.new_k),
            "v": torch.equal(batch.new_v, python_batch.new_v), "changed": not torch.equal(got, expected * 0),
        })
        return got

    monkeypatch.setattr(cpu_decoder.FusedLayers, "run", run)
    return seen


@pytest.mark.parametrize("kv_dtype, act_planes", [("fp8_e4m3", 2), ("bf16", 2), ("fp8_e4m3", 1)])
def test_fused_steps_equal_the_python_layers_bit_for_bit(native, libm_silu, monkeypatch, tiny_llama_dir, kv_dtype, act_planes):
    """With one activation plane too: were the fused layers to quantize with two, no step would match."""
    engine = make_engine(tiny_llama_dir, weights="int4", kv_dtype=kv_dtype, act_planes=act_planes)
    assert engine.runner.model.fused_layers is not None, cpu_decoder.unsupported(engine.runner.model)
    assert {spec[4] for layer in cpu_decoder.plan_args(engine.runner.model)[0] for spec in layer[2:]} == {act_planes}
    seen = _fused_checked_against_python(monkeypatch, engine.runner.model)
    outputs = run_staggered(engine, random_prompts(), GREEDY)
    assert all(len(o) == GREEDY.max_tokens for o in outputs)
    assert seen and all(s["hidden"] and s["k"] and s["v"] and s["changed"] for s in seen), [s for s in seen if not s["hidden"]]
    # The steps compared include several decode groups at once and short chunks beside decodes.
    assert max(s["groups"] for s in seen) >= 2
    assert any(s["chunks"] and s["groups"] for s in seen)
    assert max(s["tokens"] for s in seen) <= cpu_decoder.MAX_ROWS


def test_the_engine_runs_small_steps_fused_and_large_ones_in_python(native, monkeypatch, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, weights="int4", max_num_batched_tokens=64)
    model = engine.runner.model
    fused_tokens, python_tokens = [], []
    fused_run = cpu_decoder.FusedLayers.run
    monkeypatch.setattr(cpu_decoder.FusedLayers, "run", lambda self, h, b: fused_tokens.append(h.shape[0]) or fused_run(self, h, b))
    layer_forward = type(model.layers[0]).forward
    monkeypatch.setattr(type(model.layers[0]), "forward",
                        lambda self, h, r, b: (python_tokens.append(h.shape[0]) if self is model.layers[0] else None) or layer_forward(self, h, r, b))
    fused = run_staggered(engine, random_prompts((40, 3, 60)), GREEDY)
    assert fused_tokens and max(fused_tokens) <= cpu_decoder.MAX_ROWS
    assert python_tokens and min(python_tokens) > cpu_decoder.MAX_ROWS  # the 40- and 60-token prefills
    # Switched off, every step takes the Python layers, to the same greedy tokens on this model.
    monkeypatch.setattr(cpu_decoder, "NATIVE_DECODER", False)
    fused_tokens.clear()
    engine.reset_prefix_cache()
    assert run_staggered(engine, random_prompts((40, 3, 60)), GREEDY) == fused
    assert not fused_tokens


def test_models_the_c_layers_do_not_cover_say_why_and_keep_the_python_layers(native, tiny_llama_dir, tiny_mixtral_dir):
    cases = [
        (make_engine(tiny_llama_dir, weights="fp32"), "dense"),
        (make_engine(tiny_llama_dir, weights="int4", dtype="bfloat16"), "float32"),
        (make_engine(tiny_mixtral_dir, weights="int4"), "mixture of experts"),
    ]
    for engine, reason in cases:
        assert engine.runner.model.fused_layers is None
        assert reason in cpu_decoder.unsupported(engine.runner.model)
        [out] = engine.generate([[5, 6, 7]], GREEDY)
        assert len(out.output_token_ids) == GREEDY.max_tokens


def test_bad_plans_and_steps_are_refused_naming_the_argument_and_leave_hidden_untouched(native, tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, weights="int4")
    model, pool = engine.runner.model, engine.kv_cache.native
    layers, dims = cpu_decoder.plan_args(model)
    wrong = (layers[0][:2] + ((layers[0][2][0], layers[0][2][1][:-1], *layers[0][2][2:]),) + layers[0][3:],) + layers[1:]
    with pytest.raises(ValueError, match="layer 0 qkv: .* bytes, expected"):
        native.plan(wrong, *dims)
    with pytest.raises(ValueError, match="layer 1 o: format 7"):
        native.plan((layers[0], layers[1][:3] + ((7, *layers[1][3][1:]),) + layers[1][4:]) + layers[2:], *dims)
    with pytest.raises(ValueError, match="layer 0 down: .*, 3 activation planes; expected .* 1 or 2 planes"):
        native.plan((layers[0][:5] + (layers[0][5][:4] + (3,),),) + layers[1:], *dims)
    plan = native.plan(layers, *dims)
    c = model.config
    tokens = 2
    hidden = torch.randn(tokens, c.hidden_size)
    before = hidden.clone()
    rope = torch.zeros(tokens, c.head_dim)
    kv = torch.empty(tokens, c.num_layers, c.num_kv_heads, c.head_dim)
    starts, query_starts = np.array([3, 0]), np.array([0, 1, 2])

    def run(hidden=hidden, tables=np.array([[0], [1]]), starts=starts, k=kv):
        native.run(plan, hidden.numpy(), rope.numpy(), rope.numpy(), k.numpy(), kv.numpy(), pool.array, pool.layout_args,
                   tables, starts, query_starts, 1)

    with pytest.raises(ValueError, match="hidden"):
        run(hidden=torch.randn(tokens, c.hidden_size + 1))
    with pytest.raises(ValueError, match="new_k"):
        run(k=torch.empty(tokens + 1, c.num_layers, c.num_kv_heads, c.head_dim))
    with pytest.raises(ValueError, match="block_tables: sequence 1 names block"):
        run(tables=np.array([[0], [engine.kv_cache.num_blocks]]), starts=np.array([3, 5]))
    with pytest.raises(ValueError, match="starts: sequence 0 starts at position 40"):
        run(starts=np.array([40, 0]))
    assert torch.equal(hidden, before)
    run()  # the same arguments, fixed, run
    assert not torch.equal(hidden, before) and bool(torch.isfinite(hidden).all())
