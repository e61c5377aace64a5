"""2:4 semi-structured sparse weights on CUDA give the dense pruned layers' outputs."""

import pytest
import torch

from engine.layers.mlp import GatedMLP
from engine.parallel.group import TPGroup
from engine.sparsity import is_2_4, prune_model_2_4, to_semi_structured

pytestmark = pytest.mark.gpu


def test_semi_structured_mlp_matches_dense_pruned():
    torch.manual_seed(0)
    mlp = GatedMLP(hidden_size=512, intermediate=range(1024), tp=TPGroup.single())
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mlp = mlp.to("cuda", torch.bfloat16).eval()
    stats = prune_model_2_4(mlp)
    assert stats["layers"] == 2 and is_2_4(mlp.gate_up_proj.weight)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense = mlp(x)
        swapped = to_semi_structured(mlp)
        sparse = mlp(x)
    assert swapped == {"layers": 2, "dense_layers": []}
    assert type(mlp.down_proj.weight).__name__.startswith("SparseSemiStructuredTensor")
    torch.testing.assert_close(sparse, dense, rtol=2e-2, atol=2e-3)
