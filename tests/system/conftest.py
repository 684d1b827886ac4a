"""The multi-process tests: every test here is marked slow (`make test-fast` leaves them out, CI
runs them), and the fixtures they share with the unit tests of the same code."""

from pathlib import Path

import pytest

from tests.support.brokers import broker  # noqa: F401
from tests.support.device_check import failed_smoke, quick_check  # noqa: F401
from tests.support.echo import stub  # noqa: F401

HERE = Path(__file__).resolve().parent


# The fixtures done once per run (`tests.support.once`) whose other tests only read what they
# left: the device check's quick run (~50-70 s on 2 cores) and its failed smoke (~20 s). (Not
# the image: its tests run containers, up to 35 s, which at the end would be the run's tail.)
ONCE = ("quick_check", "failed_smoke")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
    items[:] = _once_spread(items)


def _once_spread(items: list[pytest.Item]) -> list[pytest.Item]:
    """The first test of each once-per-run fixture where it was, the others that need only
    fixtures already begun by then at the end of the run. `make test` deals one test at a time
    to whichever worker is free, so a module's next test went to the other worker at once,
    which then waited on the first's lock for the whole quick run (38-45 s of a worker in CI);
    at the end they read what it left."""
    begun: set[str] = set()
    kept, later = [], []
    for item in items:
        needs = {f for f in ONCE if f in getattr(item, "fixturenames", ())}
        if needs and needs <= begun:
            later.append(item)
        else:
            begun |= needs
            kept.append(item)
    return kept + later
