"""2:4 pruning: the pattern, which weights it keeps (by magnitude and by activations), and a pruned engine model."""

import pytest
import torch

from engine.errors import UnsupportedModelError
from engine.parallel.layers import ColumnParallelLinear
from engine.step_plan import PlannedChunk, StepPlan
from engine.sparsity import input_norms, is_2_4, mask_2_4, prune_model_2_4
from tests.unit.engine.helpers import make_engine, random_prompts


def test_every_group_of_four_keeps_its_two_largest():
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    mask = mask_2_4(weight)
    groups, kept = weight.abs().view(8, 8, 4), mask.view(8, 8, 4)
    assert (kept.sum(-1) == 2).all()
    smallest_kept = groups.masked_fill(~kept, float("inf")).amin(-1)
    largest_dropped = groups.masked_fill(kept, -1.0).amax(-1)
    assert (smallest_kept > largest_dropped).all()
    assert is_2_4(weight * mask) and not is_2_4(weight)


def test_activation_norms_change_which_weights_are_kept():
    """Small weights on loud inputs outrank large weights on quiet ones (|w| * ||x||)."""
    weight = torch.tensor([[1.0, -0.9, 0.2, -0.1], [0.1, 0.2, -0.9, 1.0]])
    loud_last_two = torch.tensor([1.0, 1.0, 10.0, 10.0])
    assert mask_2_4(weight).tolist() == [[True, True, False, False], [False, False, True, True]]
    assert mask_2_4(weight, loud_last_two).tolist() == [[False, False, True, True], [False, False, True, True]]


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="groups of 4"):
        mask_2_4(torch.ones(2, 6))
    with pytest.raises(ValueError, match="input_norms"):
        mask_2_4(torch.ones(2, 8), torch.ones(4))


def test_quantized_weights_are_refused():
    layer = ColumnParallelLinear(8, [(None, range(4))])
    layer.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.int8), requires_grad=False)
    model = torch.nn.ModuleDict({"proj": layer})
    with pytest.raises(UnsupportedModelError, match=r"proj\.weight is torch\.int8"):
        prune_model_2_4(model)


def test_a_model_loaded_with_quantized_weights_is_refused(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, weights="int8")
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.self_attn\.qkv_proj.*quantized"):
        prune_model_2_4(engine.runner.model)


def _all_logits(engine, prompt):
    blocks = engine.pool.allocate(-(-len(prompt) // engine.config.block_size))
    chunk = PlannedChunk(start=0, num_tokens=len(prompt), token_ids=tuple(prompt), block_ids=tuple(blocks))
    plan = StepPlan(decodes=(), prefills=(chunk,), sample_rows=tuple(range(len(prompt))))
    return lambda: engine.runner.run(plan)


def test_pruned_tiny_model_runs_close_to_dense(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, weights="fp32")
    model = engine.runner.model
    [prompt] = random_prompts([24])
    run = _all_logits(engine, prompt)
    dense = run()
    head_before = model.lm_head.weight.clone()

    stats = prune_model_2_4(model)

    num_layers = engine.model_config.num_layers
    assert stats["method"] == "magnitude" and stats["layers"] == 4 * num_layers  # qkv, o, gate_up, down
    assert stats["weights_pruned"] * 2 == stats["weights_total"]
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert is_2_4(proj.weight)
    assert torch.equal(model.lm_head.weight, head_before)
    pruned = run()
    assert torch.isfinite(pruned).all()
    assert not torch.equal(pruned, dense)
    assert torch.cosine_similarity(pruned.flatten(), dense.flatten(), dim=0) > 0.8


def test_calibrated_pruning_keeps_weights_magnitude_would_drop(tiny_llama_dir):
    magnitude_engine, wanda_engine = make_engine(tiny_llama_dir, weights="fp32"), make_engine(tiny_llama_dir, weights="fp32")
    [prompt] = random_prompts([24], seed=3)
    prune_model_2_4(magnitude_engine.runner.model)
    stats = prune_model_2_4(wanda_engine.runner.model, calibration=_all_logits(wanda_engine, prompt))

    assert stats["method"] == "wanda" and stats["weights_pruned"] * 2 == stats["weights_total"]
    by_magnitude = magnitude_engine.runner.model.layers[0].mlp.down_proj.weight != 0
    by_activation = wanda_engine.runner.model.layers[0].mlp.down_proj.weight != 0
    assert is_2_4(wanda_engine.runner.model.layers[0].mlp.down_proj.weight)
    assert (by_magnitude != by_activation).any()


def test_input_norms_are_each_features_l2_norm_over_the_calibration_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, weights="fp32")
    model = engine.runner.model
    [prompt] = random_prompts([24], seed=4)
    norms = input_norms(model, _all_logits(engine, prompt))
    with torch.no_grad():
        first_layer_input = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(prompt)))
    assert set(norms) == {f"layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    torch.testing.assert_close(norms["layers.0.self_attn.qkv_proj"], first_layer_input.norm(dim=0), rtol=1e-5, atol=1e-6)
