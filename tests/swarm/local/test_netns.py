"""The namespace lab for real (root; CI runs as root): a host on a private LAN dials out through
its NAT router, masqueraded; nobody dials in, not even a public host that routes to the LAN on
purpose (the router's firewall drops it, and without the firewall the same dial opens); each way
of a link is shaped on its own; nothing is left behind, by the run or by a run killed midway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.local import nat, netns
from tests.support import namespaces

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "swn-"
PUBLIC = {"pub": "10.81.0.10", "other": "10.81.0.11"}
LAN = netns.Lan("home", "10.81.0.2", "192.168.81.0/24", {"inside": "192.168.81.10"})
PORT = 7000
MB2 = 2_000_000


@pytest.fixture
def lab() -> Iterator[netns.Network]:
    with namespaces.network(PREFIX, PUBLIC, [LAN]) as net:
        yield net


def _namespaces() -> list[str]:
    return [line.split()[0] for line in netns.sh("ip", "netns", "list").splitlines() if line]


def test_a_lan_host_dials_out_through_its_router_masqueraded(
    lab: netns.Network, tmp_path: Path
) -> None:
    listener = namespaces.listen(lab, "pub", PORT, tmp_path)
    dialed = namespaces.dial(lab, "inside", PUBLIC["pub"], PORT, send=1000, want=1000)
    assert dialed.ok, dialed.error
    # the public host sees the router's public address, never the LAN's
    assert namespaces.seen_peers(listener) == [LAN.public]
    listener.kill()


def test_nobody_dials_into_a_lan(lab: netns.Network, tmp_path: Path) -> None:
    listener = namespaces.listen(lab, "inside", PORT, tmp_path)
    # a public host has no route into the LAN
    assert "192.168.81" not in netns.sh("ip", "-n", lab.ns["pub"], "route")
    no_route = namespaces.dial(lab, "pub", LAN.hosts["inside"], PORT)
    assert not no_route.ok
    # nor does the router take connections on its own public address (no forwarded port)
    assert not namespaces.dial(lab, "pub", LAN.public, PORT, timeout=2).ok
    # a public host that routes to the LAN through the router anyway: the firewall drops it
    route = f"ip -n {lab.ns['pub']} route add {LAN.subnet} via {LAN.public}"
    netns.sh(*route.split())
    before = lab.dropped("home")
    dropped = namespaces.dial(lab, "pub", LAN.hosts["inside"], PORT, timeout=2)
    assert not dropped.ok and "timed out" in dropped.error, dropped
    assert lab.dropped("home") > before
    assert namespaces.seen_peers(listener) == []
    # the control: the same dial with the router's forward chain open gets through, so it was
    # the firewall (not a missing route) that kept it out
    router = lab.routers["home"]
    netns.sh("ip", "netns", "exec", router, "nft", "flush", "chain", "ip", nat.TABLE, "forward")
    netns.sh(
        *f"ip netns exec {router} nft chain ip {nat.TABLE} forward {{ policy accept ; }}".split()
    )
    opened = namespaces.dial(lab, "pub", LAN.hosts["inside"], PORT)
    assert opened.ok, opened.error
    assert namespaces.seen_peers(listener) == [PUBLIC["pub"]]
    listener.kill()


def test_each_way_of_a_link_is_shaped_on_its_own(lab: netns.Network, tmp_path: Path) -> None:
    """2 MB up at 10 Mbit/s takes at least ~1.5 s (the bucket holds 128 KiB), down at 100
    Mbit/s at least ~0.15 s; the bounds are the rates' (nothing beats them), the ordering the
    point: upload and download are shaped apart. A LAN host shapes the same way."""
    for host, peer, address in (
        ("pub", "other", PUBLIC["other"]),
        ("inside", "other", PUBLIC["other"]),
    ):
        lab.shape_host(host, 10e6, 100e6)
        listener = namespaces.listen(lab, peer, PORT, tmp_path)
        up = namespaces.dial(lab, host, address, PORT, send=MB2, timeout=10)
        down = namespaces.dial(lab, host, address, PORT, want=MB2, timeout=10)
        listener.kill()
        assert up.ok and down.ok, (up, down)
        assert up.seconds > 1.2, up
        assert down.seconds > 0.1, down
        assert down.seconds < up.seconds, (host, up, down)
        assert up.seconds < 60
        lab.shape_host(host, None, None)
    # unshaped again: 2 MB up is nowhere near 10 Mbit/s's 1.6 s
    listener = namespaces.listen(lab, "other", PORT, tmp_path)
    assert namespaces.dial(lab, "pub", PUBLIC["other"], PORT, send=MB2).ok
    listener.kill()


def test_destroy_leaves_no_namespace() -> None:
    with namespaces.network(PREFIX, PUBLIC, [LAN]) as net:
        made = [ns for ns in _namespaces() if ns.startswith(f"{net.tag}-")]
        assert sorted(made) == sorted([net.net, *net.ns.values(), *net.routers.values()])
    assert [ns for ns in _namespaces() if ns.startswith(f"{net.tag}-")] == []


# The killed run's own prefix: every lab of the tests here sweeps "swn-" leftovers as it starts
# (`tests.support.namespaces.network`), and under `make test` one may start on the other worker
# while this test counts what its own sweep removes (CI: "swn-22177-net" gone from under it).
KILLED_PREFIX = "swk-"

_MAKER = f"""
import sys, time
from swarm.local import netns
lan = netns.Lan("home", "10.82.0.2", "192.168.82.0/24", {{"inside": "192.168.82.10"}})
net = netns.Network("{KILLED_PREFIX}", {{"pub": "10.82.0.10"}}, [lan])
net.create()
print("made", net.tag, flush=True)
time.sleep(600)
"""


def test_a_killed_run_s_routers_and_lans_are_removed_by_the_next() -> None:
    if problem := netns.available(routers=True):
        pytest.skip(problem)
    maker = subprocess.Popen(
        [sys.executable, "-c", _MAKER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert maker.stdout is not None
        tag = maker.stdout.readline().split()[1]
    finally:
        maker.send_signal(signal.SIGKILL)  # no cleanup: the namespaces stay behind
        maker.wait(10)
        if maker.stdout is not None:
            maker.stdout.close()
    left = [ns for ns in _namespaces() if ns.startswith(f"{tag}-")]
    assert f"{tag}-home" in left and f"{tag}-inside" in left
    # a process still inside a router is killed with it
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{tag}-home", "sleep", "600"])
    try:
        time.sleep(0.3)
        namespaces.network_sweep(PREFIX)  # another lab starts meanwhile, on the other worker
        removed = netns.remove_leftovers(KILLED_PREFIX, lambda pid: Path(f"/proc/{pid}").exists())
        assert sorted(left) == sorted(n for n in removed if n.startswith(f"{tag}-"))
        assert [ns for ns in _namespaces() if ns.startswith(f"{tag}-")] == []
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        sleeper.kill()  # a failed assertion: not left running (a no-op once it ended)
        sleeper.wait(10)


# An xdist worker's command line, as execnet starts it: no "pytest" in it.
_WORKER = "import sys;exec(eval(sys.stdin.readline()))"


def test_a_lab_made_by_another_xdist_worker_is_not_a_leftover() -> None:
    """`make test`'s two workers each make their labs; a lab's maker is the worker's pid. CI saw
    one worker's test remove the other's namespaces as leftovers mid-test ("Cannot open network
    namespace swn-18613-pub"): a maker counted as alive only if its command line named pytest,
    and a worker's does not. A maker that is gone is still a leftover's."""
    worker = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE)
    try:
        assert namespaces.maker_alive(worker.pid), "a live xdist worker counted as gone"
    finally:
        worker.kill()
        worker.wait(10)
        if worker.stdin is not None:
            worker.stdin.close()
    assert not namespaces.maker_alive(worker.pid), "a maker that is gone counted as alive"
