"""The package's optional C extensions (setup.py) as tests take them."""

from __future__ import annotations

import os
from types import ModuleType

import pytest


def built_or_skip(extension: ModuleType | None, name: str, needs: str, fallback: str) -> ModuleType:
    """``extension`` (its wrapper's handle, None when it did not build). Where it is not built
    ``fallback`` serves and the calling test skips, unless SPLITSERVE_REQUIRE_NATIVE=1 (``make
    test``) says it must be: then the test fails naming what the build ``needs``."""
    if extension is None:
        if os.environ.get("SPLITSERVE_REQUIRE_NATIVE") == "1":
            pytest.fail(f"{name} is not built (SPLITSERVE_REQUIRE_NATIVE=1): `pip install -e .` needs {needs}; "
                        "see the build log for why it failed")
        pytest.skip(f"{name} is not built: {fallback}")
    return extension
