"""`swarm.rpc.status`'s trailing metadata names a swarm error's class, and only a swarm error's."""

from __future__ import annotations

from swarm.errors import ActivationsNotCached
from swarm.rpc.status import ERROR_KEY, error_metadata


class NotFound(Exception):  # a third-party error that happens to share a swarm error's name
    pass


def test_only_swarm_errors_are_named_in_the_metadata() -> None:
    assert (ERROR_KEY, "ActivationsNotCached") in error_metadata(ActivationsNotCached("x"))
    assert error_metadata(NotFound("elsewhere")) == ()
