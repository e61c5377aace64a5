"""What every Triton kernel wrapper shares: whether Triton interprets kernels, and the device check.

Imports no Triton, so a host without it can import the kernel modules and their references.
"""

from __future__ import annotations

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton runs kernels in its interpreter when this is set before Triton is first imported (tests/conftest.py does so without CUDA)."""


def check_device(kernel: str, tensor: torch.Tensor) -> None:
    """Refuses a CPU tensor unless Triton interprets kernels (``TRITON_INTERPRET=1``)."""
    if tensor.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"{kernel} runs on CUDA tensors, or on CPU when TRITON_INTERPRET=1 was set before "
            f"Triton was first imported; the input is on {tensor.device}"
        )
