"""The multi-process tests: every test here is marked slow (`make test-fast` leaves them out, CI
runs them), and the fixtures they share with the unit tests of the same code."""

from pathlib import Path

import pytest

from tests.support.brokers import broker  # noqa: F401
from tests.support.device_check import failed_smoke, quick_check  # noqa: F401
from tests.support.echo import stub  # noqa: F401
from tests.support.once import once_first

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
    # the device check's quick run and failed smoke, and the container image (its build ~95 s,
    # which the other worker waited out on the lock when the next container test went there):
    # done by their first asker, read by the rest
    items[:] = once_first(items, ("quick_check", "failed_smoke", "built"))
