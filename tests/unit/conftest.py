"""Fixtures shared by the unit tests' modules."""
from __future__ import annotations

import pytest
from deploy_render import _find_renderer


@pytest.fixture(scope="module")
def renderer() -> list[str] | None:
    """The deploy tests' render command, or None; render() then FAILS the test (never skips it)."""
    return _find_renderer()[0]
