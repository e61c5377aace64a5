"""The one compiled part of the package: kv_store._chain, the block-key chain in C.

Everything else is in pyproject.toml. The extension is optional: where it does not build (no C
compiler, no xxhash.h from libxxhash-dev), the install goes on and kv_store.keys hashes in Python,
to the same keys. ``SPLITSERVE_REQUIRE_NATIVE=1`` makes the tests fail in that case.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kv_store._chain", ["kv_store/_chain.c"], extra_compile_args=["-O3"], optional=True),
    ],
)
