"""Triton kernels compiled for sm_90a (Hopper) on a host without a GPU, for the kernel tests.

The interpreter runs the kernels' arithmetic, not Triton's compiler: loop-carried types,
layouts, shared memory, registers and FMA contraction are only checked by compiling. Triton's
wheel carries ptxas, so a launch is compiled for sm_90a in a subprocess without
``TRITON_INTERPRET`` and measured:

- ``compile_for_sm90(launches)``: each launch given as a ``Launch`` (argument kinds written out,
  as test_fused_norm.py and test_rope_kv.py do), one ``CompiledKernel`` each;
- ``capture_launches(monkeypatch, kernels, calls)``: the launches the wrappers make in
  ``calls()``, captured instead of run (arguments specialized as Triton's launcher does);
- ``hopper_resources(monkeypatch, calls)``: both for the paged decode and prefill kernels, the
  wrappers taking the GPU's branches; ``empty_pool`` gives them a pool to capture launches on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from kv_store.layout import KVBlockLayout

REPO = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 600

_COMPILE_SCRIPT = r"""
import importlib, json, re, subprocess, sys, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas
from triton.compiler import ASTSource

results = []
for launch in json.load(sys.stdin):
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in launch["constexprs"]:
            encoded = launch["constexprs"][name]
            signature[name], constexprs[name] = "constexpr", tl.dtype(encoded["dtype"]) if isinstance(encoded, dict) else encoded
        else:
            signature[name] = launch["signature"][name]
            if launch["attrs"].get(name):
                attrs[(index,)] = CUDABackend.parse_attr(launch["attrs"][name])
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=launch["options"])
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as ptx:
        ptx.write(kernel.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"], capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    results.append({"kernel": launch["kernel"], "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
                    "spill_bytes": sum(spills), "shared_bytes": kernel.metadata.shared,
                    "fma_f32": kernel.asm["ptx"].count("fma.rn.f32")})
print(json.dumps(results))
"""


@dataclass(frozen=True)
class Launch:
    """One kernel to compile: ``module.kernel`` with its arguments' kinds and its constexprs."""

    module: str
    """The kernel's module, importable from the repository root (``engine.kernels.rope_kv``)."""
    kernel: str
    """The ``@triton.jit`` function's name in it."""
    signature: dict[str, str]
    """Each argument that is not a constexpr by its kind: ``"*fp32"``, ``"*u8"``, ``"i32"``, ``"fp32"``."""
    constexprs: dict[str, object]
    """Each constexpr's value; a Triton dtype as ``{"dtype": "fp32"}``."""
    options: dict[str, object] = field(default_factory=dict)
    """``triton.compile`` options: ``num_warps``, ``num_stages``, ``enable_fp_fusion``, ..."""
    attrs: dict[str, str] = field(default_factory=dict)
    """Pointer and integer attributes by argument, as Triton's launcher specializes them (``"D"``: divisible by 16)."""


@dataclass(frozen=True)
class CompiledKernel:
    """One launch compiled for sm_90a, as ptxas reports it."""

    kernel: str
    registers: int
    """Registers per thread."""
    spill_bytes: int
    """Spill stores and loads, in bytes."""
    shared_bytes: int
    """Shared memory per program."""
    fma_f32: int
    """``fma.rn.f32`` instructions in the PTX: float32 multiply-adds contracted into one rounding."""


def compile_for_sm90(launches: Sequence[Launch]) -> list[CompiledKernel]:
    """Compiles each launch for sm_90a in a subprocess without ``TRITON_INTERPRET``; one result per launch, in order."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], input=json.dumps([asdict(launch) for launch in launches]),
        env=env, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [CompiledKernel(**result) for result in json.loads(done.stdout.splitlines()[-1])]


class _CapturedKernel:
    """Stands in for a ``@triton.jit`` kernel: a launch records a ``Launch`` of its specialized arguments instead of running."""

    def __init__(self, module: ModuleType, name: str, launches: list[Launch]) -> None:
        self.module, self.name, self.launches = module.__name__, name, launches
        self.arg_names = getattr(module, name).arg_names

    def __getitem__(self, grid):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        def launch(*args, num_warps: int, num_stages: int = 3, **constexprs):
            signature, attrs = {}, {}
            constexprs = {k: {"dtype": str(v)} if hasattr(v, "primitive_bitwidth") else v for k, v in constexprs.items()}
            for name, arg in zip(self.arg_names, args):
                kind, value = native_specialize_impl(BaseBackend, arg, False, True, True)
                if kind == "constexpr":
                    constexprs[name] = value
                else:
                    signature[name], attrs[name] = kind, value
            options = {"num_warps": num_warps, "num_stages": num_stages}
            self.launches.append(Launch(self.module, self.name, signature, constexprs, options, attrs))

        return launch


def capture_launches(monkeypatch, kernels: Sequence[tuple[ModuleType, str]], calls: Callable[[], None]) -> list[Launch]:
    """The launches of ``kernels`` (``(module, name)``) that ``calls()`` makes, in order, none of them run."""
    launches: list[Launch] = []
    for module, name in kernels:
        monkeypatch.setattr(module, name, _CapturedKernel(module, name, launches))
    calls()
    return launches


def hopper_resources(monkeypatch, calls: Callable[[], None]) -> list[CompiledKernel]:
    """Registers, spilled bytes and shared memory of every paged-attention launch ``calls()`` makes, compiled for sm_90a.

    The wrappers run as on a GPU: the GPU's dot dtypes (``paged_kv.INTERPRETED`` False) and no device check.
    """
    from engine.kernels import paged_attention, paged_kv, paged_prefill

    monkeypatch.setattr(paged_kv, "INTERPRETED", False)
    for module in (paged_attention, paged_prefill):
        monkeypatch.setattr(module, "check_device", lambda kernel, tensor: None)
    kernels = ((paged_attention, "_paged_decode_kernel"), (paged_attention, "_combine_kernel"), (paged_prefill, "_paged_prefill_kernel"))
    return compile_for_sm90(capture_launches(monkeypatch, kernels, calls))


def empty_pool(kv_dtype: str, num_blocks: int = 4, block_size: int = 16) -> tuple[torch.Tensor, KVBlockLayout]:
    """A zeroed pool in Llama-3-8B's KV shapes (8 KV heads of 128), for launches that are captured, not run."""
    layout = KVBlockLayout(2, 8, 128, block_size, kv_dtype)
    return torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8), layout
