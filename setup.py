"""The compiled parts of the package, each an optional C extension; everything else is in pyproject.toml.

- kv_store._chain: the block-key chain (needs xxhash.h from libxxhash-dev).
- engine.kernels._cpu_attention: paged attention and FP8 KV writes on CPU (OpenMP, sharing the
  libgomp that torch ships: engine/kernels/cpu_attention.py imports torch before it).

Where one does not build (no C compiler, a missing header), the install goes on and the Python
path serves, to the same results. ``SPLITSERVE_REQUIRE_NATIVE=1`` makes the tests fail in that case.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kv_store._chain", ["kv_store/_chain.c"], extra_compile_args=["-O3"], optional=True),
        Extension(
            "engine.kernels._cpu_attention",
            ["engine/kernels/_cpu_attention.c"],
            depends=["engine/kernels/_cpu_attention_loops.h"],
            extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"],  # see the C file's head
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        ),
    ],
)
