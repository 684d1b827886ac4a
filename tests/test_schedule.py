"""`make test`'s workers (`tests.support.schedule`): a module of `ONE_WORKER` is one scope, so one
worker runs it whole; every other test is a scope of its own. And each module named there
exists: a renamed one would be spread over both workers again, silently."""

from __future__ import annotations

from typing import Any, cast

from tests.support.cli import ROOT
from tests.support.schedule import ONE_WORKER, ModulesWhole

CONTAINER = "tests/system/test_container.py"


def _scope(nodeid: str) -> str:
    return ModulesWhole._split_scope(cast(Any, None), nodeid)  # reads nothing of the scheduler


def test_a_module_kept_whole_is_one_scope_and_any_other_test_its_own() -> None:
    whole = {_scope(f"{CONTAINER}::test_{name}") for name in ("build", "run", "inside[x]")}
    assert whole == {CONTAINER}
    other = "tests/system/test_control_plane.py::test_wrong_token_is_refused"
    assert _scope(other) == other
    param = "tests/swarm/model/test_generate.py::test_a[llama]"
    assert _scope(param) == param


def test_every_module_kept_whole_exists() -> None:
    assert CONTAINER in ONE_WORKER
    assert [m for m in sorted(ONE_WORKER) if not (ROOT / m).is_file()] == []
