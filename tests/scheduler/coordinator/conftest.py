"""Fixtures of the coordinator's unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.coordinator import Harness


@pytest.fixture
async def made() -> AsyncIterator[list[Harness]]:
    """The harnesses a test made, each coordinator closed after it."""
    harnesses: list[Harness] = []
    yield harnesses
    for h in harnesses:
        await h.coordinator.close()
