"""How `make test`'s two workers (pytest-xdist, `--dist loadgroup`) share the suite: test by test,
but a module of `ONE_WORKER` whole, in one worker; and those modules first, then the rest in
the order collected (the slow tests first: `tests/conftest.py`).

Before, `-n 2` handed tests out one by one (xdist's `load`), so the container module's could run
in both workers, each building the image in its module fixture. xdist's own `loadgroup` would
keep an `xdist_group` together, but its workers append the group to `Node._nodeid`, which pytest
9's ids no longer read (`Node._id`): each test stays a group of its own. Here the groups are
named by module instead, read from the ids the workers send."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

__all__ = ["ONE_WORKER", "ModulesWhole"]

ONE_WORKER = frozenset({"tests/system/test_container.py"})
"""Modules run whole in one worker: the container module's fixture builds the image (minutes, a
module's fixture: once a worker), and its in-container tests build on that image's layers."""


class ModulesWhole(LoadScopeScheduling):
    """xdist's scope scheduling, a scope being one test, or one module of `ONE_WORKER`. Scopes
    are handed out largest first (xdist's `--loadscope-reorder`, on by default), so those
    modules start at once."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if module in ONE_WORKER else nodeid
