"""The compiled parts of the package, each an optional C extension; everything else is in pyproject.toml.

- kv_store._chain: the block-key chain (needs xxhash.h from libxxhash-dev).
- engine.quant._qmatmul: quantized matmuls for decode steps (AVX-512 VNNI or AVX2).
- engine.kernels._cpu_attention: paged attention and FP8 KV writes on CPU.
- engine.kernels._cpu_norm: RMSNorm of float32 rows.
- engine.kernels._cpu_decoder: a small step's decoder layers in one call, through the C APIs
  (engine/kernels/native_api.h) of _qmatmul and _cpu_attention; it needs both.

The two engine kernels use OpenMP and share the libgomp that torch ships: their wrappers
(engine/quant/native.py, engine/kernels/cpu_attention.py) import torch before them. Where one does
not build (no C compiler, a missing header), the install goes on and the Python path serves, to the
same results (kv_store.keys hashes in Python; engine.quant.kernels runs torch's int4 kernel; the
attention layers gather and run SDPA). ``SPLITSERVE_REQUIRE_NATIVE=1`` makes the tests fail in that case.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kv_store._chain", ["kv_store/_chain.c"], extra_compile_args=["-O3"], optional=True),
        Extension(
            "engine.quant._qmatmul",
            ["engine/quant/_qmatmul.c"],
            include_dirs=["engine/kernels"],
            depends=["engine/kernels/native_api.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "engine.kernels._cpu_attention",
            ["engine/kernels/_cpu_attention.c"],
            depends=["engine/kernels/_cpu_attention_loops.h", "engine/kernels/_cpu_attention_avx512.h",
                     "engine/kernels/_cpu_attention_split.h", "engine/kernels/native_api.h"],
            extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"],  # see the C file's head
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        ),
        Extension("engine.kernels._cpu_norm", ["engine/kernels/_cpu_norm.c"], depends=["engine/kernels/_rms_norm.h"], extra_compile_args=["-O3"],
                  libraries=["m"], optional=True),
        Extension(
            "engine.kernels._cpu_decoder",
            ["engine/kernels/_cpu_decoder.c"],
            depends=["engine/kernels/_rms_norm.h", "engine/kernels/native_api.h"],
            extra_compile_args=["-O3", "-ffp-contract=off"],  # the Python path's float order, see the C file's head
            libraries=["m"],
            optional=True,
        ),
    ],
)
