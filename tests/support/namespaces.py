"""Hosts of their own for one test: network namespaces (`swarm.local.netns`) made for it and
removed after it, with what a run killed before it cleaned up left behind removed first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from swarm.local import netns

__all__ = ["PROXIES", "network"]

PROXIES = {"http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "no_proxy"}
"""Variables (any case) a process in a namespace must not have: gRPC would dial through them."""


def _alive(pid: int) -> bool:
    try:
        return b"pytest" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@contextlib.contextmanager
def network(prefix: str, addresses: Mapping[str, str]) -> Iterator[netns.Network]:
    """A namespace per host of `addresses`, on one bridge; the test is skipped where namespaces
    cannot be made (not root: CI runs as root, so there it always runs)."""
    problem = netns.available()
    if problem:
        pytest.skip(problem)
    netns.remove_leftovers(prefix, _alive)
    net = netns.Network(prefix, addresses)
    try:
        net.create()
        yield net
    finally:
        net.destroy()
