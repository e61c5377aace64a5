"""2:4 semi-structured sparsity for the engine's linear projections.

In every group of 4 consecutive input weights of a row, 2 are kept and 2 set to zero: the
pattern NVIDIA's sparse tensor cores run at twice the dense rate, through
``torch.sparse.to_sparse_semi_structured``. Which two to keep:

- magnitude: the 2 largest ``|w|``;
- activation-aware (Wanda): the 2 largest ``|w_ij| * ||x_j||``, where ``||x_j||`` is the L2 norm
  of input feature j over calibration tokens. A small weight on a feature that carries large
  activations matters more than a large weight on a quiet one.

Pruning happens in place on the float weights, so on CPU the pruned model runs through the
same dense matmuls and only its accuracy changes (no speed is claimed there); on CUDA
``to_semi_structured`` then swaps the pruned weights for compressed sparse tensors.

The LM head (tied to the embeddings in many small models) and the MoE experts' stacked
weights are left dense: only ``ColumnParallelLinear`` / ``RowParallelLinear`` projections
(QKV, O, gate/up, down) are pruned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.errors import UnsupportedModelError
from engine.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

GROUP = 4
KEEP = 2
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mask_2_4(weight: torch.Tensor, input_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask of ``weight`` (``[out, in]``, ``in`` a multiple of 4) keeping 2 of every 4 inputs.

    Scores are ``|w|``, times ``input_norms`` (``[in]``, one per input feature) when given.
    """
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"weight: 2:4 pruning needs input features in groups of {GROUP}, got {cols}")
    scores = weight.detach().abs().float()
    if input_norms is not None:
        if input_norms.shape != (cols,):
            raise ValueError(f"input_norms: expected [{cols}] (one per input feature), got {list(input_norms.shape)}")
        scores = scores * input_norms.float()[None, :]
    groups = scores.view(rows, cols // GROUP, GROUP)
    kept = groups.topk(KEEP, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, kept, True)
    return mask.view(rows, cols)


def is_2_4(weight: torch.Tensor) -> bool:
    """True when every group of 4 consecutive inputs of every row holds at most 2 non-zeros."""
    rows, cols = weight.shape
    if cols % GROUP:
        return False
    return bool(((weight != 0).view(rows, cols // GROUP, GROUP).sum(-1) <= KEEP).all())


def prunable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's projections that 2:4 pruning applies to, by module name.

    Refuses a model with quantized weights (any integer, FP8 or packed ``*weight*`` tensor):
    their groups of 4 are not the stored values, and pruning them would need a requantization.
    """
    for name, module in model.named_modules():
        for tensor_name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if "weight" in tensor_name and tensor.dtype not in _FLOAT_DTYPES:
                raise UnsupportedModelError(
                    f"2:4 pruning needs float weights; {name or 'model'}.{tensor_name} is {tensor.dtype} "
                    "(quantized). Load the model with weights fp32 or bf16 to prune it"
                )
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not isinstance(module, ParallelLMHead)
    }
    for name, module in linears.items():
        quantized = getattr(module, "quantized", None)
        if quantized is not None or module.weight is None:
            raise UnsupportedModelError(
                f"2:4 pruning needs float weights; {name} computes with a quantized weight "
                f"({type(quantized).__name__}). Load the model with weights fp32 or bf16 to prune it"
            )
    return linears


def input_norms(model: torch.nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """L2 norm of each input feature of every prunable projection over the tokens ``run()`` feeds the model."""
    linears = prunable_linears(model)
    sums = {name: torch.zeros(module.weight.shape[1]) for name, module in linears.items()}

    def hook_for(name: str):
        def hook(module, args):
            x = args[0].detach().float()
            sums[name] += x.reshape(-1, x.shape[-1]).pow(2).sum(0).cpu()

        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: total.sqrt() for name, total in sums.items()}


def prune_model_2_4(model: torch.nn.Module, calibration: Callable[[], object] | None = None) -> dict:
    """Prune every projection of ``model`` to 2:4 in place; returns what was pruned.

    ``calibration``, when given, runs the model forward on calibration text (any forward
    passes: it is called once, with hooks recording each projection's inputs), and pruning is
    activation-aware; without it pruning is by magnitude. The result is
    ``{"method": "magnitude" | "wanda", "layers": int, "weights_total": int, "weights_pruned": int}``,
    counting the weights of the pruned layers and those set to zero.
    """
    linears = prunable_linears(model)
    norms = input_norms(model, calibration) if calibration is not None else {}
    weights_total = weights_pruned = 0
    with torch.no_grad():
        for name, module in linears.items():
            weight = module.weight
            try:
                mask = mask_2_4(weight, norms.get(name))
            except ValueError as e:
                raise UnsupportedModelError(f"{name}: {e}") from e
            weights_pruned += int((weight != 0).sum()) - int((weight * mask != 0).sum())
            weight.mul_(mask.to(weight.dtype))
            weights_total += weight.numel()
    return {
        "method": "wanda" if calibration is not None else "magnitude",
        "layers": len(linears),
        "weights_total": weights_total,
        "weights_pruned": weights_pruned,
    }


def to_semi_structured(model: torch.nn.Module) -> dict:
    """Swap each pruned projection's weight for a compressed 2:4 sparse tensor (CUDA only).

    Layers whose shape the sparse kernels cannot take (torch's per-dtype minimum rows and
    columns) stay dense and are listed. Returns ``{"layers": int, "dense_layers": [names]}``.
    """
    from torch.sparse import to_sparse_semi_structured

    swapped, dense = 0, []
    for name, module in prunable_linears(model).items():
        weight = module.weight
        if weight.device.type != "cuda":
            raise UnsupportedModelError(f"{name}: semi-structured sparse matmuls run on CUDA; the weight is on {weight.device}")
        if not is_2_4(weight):
            raise UnsupportedModelError(f"{name}: the weight is not 2:4 sparse; call prune_model_2_4 first")
        rows_min, cols_min = _min_shape(weight.dtype)
        if weight.shape[0] % rows_min or weight.shape[1] % cols_min:
            dense.append(name)
            continue
        module.weight = torch.nn.Parameter(to_sparse_semi_structured(weight.detach()), requires_grad=False)
        swapped += 1
    return {"layers": swapped, "dense_layers": dense}


def _min_shape(dtype: torch.dtype) -> tuple[int, int]:
    """(rows, columns) a weight must be a multiple of, for the backend to_sparse_semi_structured picks."""
    from torch.sparse import SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    cutlass = SparseSemiStructuredTensor._FORCE_CUTLASS
    backend = SparseSemiStructuredTensorCUTLASS if cutlass else SparseSemiStructuredTensorCUSPARSELT
    config = backend._DTYPE_SHAPE_CONSTRAINTS.get(dtype)
    if config is None:
        raise UnsupportedModelError(f"semi-structured sparsity supports {list(backend._DTYPE_SHAPE_CONSTRAINTS)}, not {dtype}")
    return config.sparse_min_rows, config.sparse_min_cols
