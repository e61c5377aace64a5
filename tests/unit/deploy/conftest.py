from __future__ import annotations

import pytest

from tests.unit.deploy.chart import EXAMPLES, render_example


@pytest.fixture(scope="session")
def example_objects() -> dict[str, list[dict]]:
    """{example name: every object its values render to}, rendered once per session."""
    return {name: render_example(name) for name in EXAMPLES}
