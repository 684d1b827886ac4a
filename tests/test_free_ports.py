"""The free ports tests hand to the processes they start (`tests.support.ports.free_port`).

CI saw a scheduler given a port the test had just found free fail to bind it: "Address already
in use" (test_ports, `test_two_flags_given_one_port_name_the_second`). The port came from the
kernel's ephemeral range, which the kernel also hands out, to every socket bound to port 0 and
to every outgoing connection's end, in the other xdist worker's tests too. So a free port now
comes from below that range, from a part of it that is this worker's alone."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.support import ports


def _ephemeral() -> range:
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_a_free_port_is_never_one_the_kernel_hands_out_itself() -> None:
    ephemeral = _ephemeral()
    assert not [p for p in (ports.free_port() for _ in range(200)) if p in ephemeral]


@pytest.mark.parametrize("worker", ["gw0", "gw1", "gw2"])
def test_each_xdist_worker_has_free_ports_of_its_own(
    worker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    mine = ports.worker_ports()
    for other in {"gw0", "gw1", "gw2"} - {worker}:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", other)
        assert not set(mine) & set(ports.worker_ports()), (worker, other)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert all(ports.free_port() in mine for _ in range(50))


def test_a_free_port_is_free() -> None:
    port = ports.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # raised "Address already in use" if it were not


def test_the_tests_take_their_free_ports_from_here_alone() -> None:
    """A test that took a bench's free port (a port-0 bind, from the kernel's ephemeral range)
    lost it now and then to the other worker's connections before its process bound it:
    tests/test_wan_bench.py's gloo rendezvous, under a loaded suite."""
    root = Path(__file__).resolve().parent
    called = re.compile(r"\b(?!ports\b)\w+\.free_port\(")  # `ports.free_port(`: here
    imported = re.compile(r"^from (\S+) import [^\n]*\bfree_port\b", re.M)
    found = [
        f"{path.relative_to(root)}: {m.group(0)}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "ports.py"
        for m in [*called.finditer(path.read_text()), *imported.finditer(path.read_text())]
        if m.re is called or m.group(1) != "tests.support.ports"
    ]
    assert found == [], found
