"""tests/native.py: an extension that did not build skips its tests, or fails them under make test."""

from __future__ import annotations

import pytest

from tests.native import built_or_skip


def test_a_missing_extension_fails_naming_its_build_needs_where_it_is_required(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_REQUIRE_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception, match=r"engine.x is not built .*needs gcc"):
        built_or_skip(None, "engine.x", "gcc", "torch serves")


def test_a_missing_extension_skips_elsewhere_and_a_built_one_is_returned(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_REQUIRE_NATIVE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="engine.x is not built: torch serves"):
        built_or_skip(None, "engine.x", "gcc", "torch serves")
    assert built_or_skip(pytest, "engine.x", "gcc", "torch serves") is pytest
