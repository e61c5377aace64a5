"""The compiled parts of the package, each optional: kv_store._chain (the block-key chain in C)
and engine.quant._qmatmul (quantized matmuls for decode steps).

Everything else is in pyproject.toml. Where an extension does not build (no C compiler, no
xxhash.h from libxxhash-dev), the install goes on and the Python paths run: kv_store.keys hashes
in Python, to the same keys; engine.quant.kernels runs torch's int4 kernel.
``SPLITSERVE_REQUIRE_NATIVE=1`` makes the tests fail in that case.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kv_store._chain", ["kv_store/_chain.c"], extra_compile_args=["-O3"], optional=True),
        # -fopenmp links libgomp.so.1, which resolves to torch's own copy (kernels.py imports torch first).
        Extension("engine.quant._qmatmul", ["engine/quant/_qmatmul.c"], extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True),
    ],
)
