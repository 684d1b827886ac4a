"""Hosts of their own on one machine: a network namespace per host, each with its own address on
one public bridge, optionally with a tbf-shaped link, the same rate both ways or one rate each
way (root only; `netem` is not needed); and private LANs, each behind a router namespace that
masquerades it and drops every connection that starts outside (`swarm.local.nat`, nftables), as
a home router does. The WAN benchmark (`bench/wan.py`), the NAT benchmark (`bench/nat.py`) and
the system tests build their swarms on it; everything is created and removed by the run that
made it (a run that died is cleaned up by the next: `remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from swarm.local import nat
from swarm.local.nat import Lan
from swarm.local.procs import Child

__all__ = [
    "Lan",
    "Launcher",
    "Network",
    "Proc",
    "available",
    "ip_netns_exec",
    "launcher",
    "remove_leftovers",
    "sh",
]

CMD_TIMEOUT_S = 30.0  # one `ip` or `tc` call


IFNAMSIZ = 15  # the longest device name Linux takes: `v-<host>` must fit


def sh(*cmd: str, check: bool = True, stdin: str | None = None) -> str:
    """Run one command (bounded), `stdin` its input; its stdout. A failure raises with its
    stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, input=stdin)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class Launcher(Protocol):
    """Runs `argv` in namespace `ns` (its name) in a session of its own, from `cwd` with `env`,
    its stdout and stderr into `out`."""

    def __call__(
        self, ns: str, argv: list[str], out: BinaryIO, env: dict[str, str], cwd: Path
    ) -> Child: ...


def ip_netns_exec(ns: str, argv: list[str], out: BinaryIO, env: dict[str, str], cwd: Path) -> Child:
    """`ip netns exec NS ARGV`: a fresh process."""
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


launcher: Launcher = ip_netns_exec
"""How `Network.start` starts processes. The test suite forks its `swarm` processes from a server
that imported torch once (`tests.support.forked`), as `swarm.local.procs.launcher` does."""


def available(routers: bool = False) -> str | None:
    """Why namespaces (with `routers`: and NAT routers) cannot be made here (not root, no `ip`,
    no `nft`), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if routers and shutil.which("nft") is None:
        return "NAT routers need nft (nftables: `make install` or apt-get install nftables)"
    try:
        sh("ip", "netns", "list")
    except (OSError, RuntimeError) as e:
        return f"`ip netns` does not work here: {e}"
    return None


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def remove_leftovers(prefix: str, alive: Callable[[int], bool]) -> list[str]:
    """Delete namespaces `<prefix><pid>-*` whose maker (`pid`) is gone, `alive(pid)` false
    (SIGKILL first any process still in them): a run killed before it cleaned up. Hosts, routers
    and the bridges' namespace are all named so; a router's ruleset and forwarding, and every
    bridge and veth, live in those namespaces and go with them. A namespace of a run still going
    is left alone."""
    removed = []
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(prefix):
            continue
        match = re.match(rf"{re.escape(prefix)}(\d+)-", name)
        if match and int(match.group(1)) != os.getpid() and alive(int(match.group(1))):
            continue
        pids = [int(p) for p in sh("ip", "netns", "pids", name, check=False).split()]
        _kill_pids(pids)
        time.sleep(0.2 if pids else 0)
        sh("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


class Network:
    """One namespace per host, each host's `eth0` a veth pair's end whose peer (`v-<host>`) is a
    port of a bridge in the network's own namespace: `br0` for the public hosts; for each LAN,
    bridge `b-<router>`, on which its hosts and the router's LAN leg (`eth1`, port `r-<router>`)
    sit. A router's public leg (`eth0`, port `v-<router>`) is on `br0`. Names are
    `<prefix><pid>-<host>` (a router's too). A public host has no route into any LAN; a LAN
    host's default route is its router."""

    def __init__(self, prefix: str, addresses: Mapping[str, str], lans: Sequence[Lan] = ()) -> None:
        self.tag = f"{prefix}{os.getpid()}"
        self.net = f"{self.tag}-net"
        self.public = dict(addresses)  # public host -> its IPv4 address, all in one /24
        self.lans = list(lans)
        # every host processes run on -> its address (a LAN host's: private)
        self.addresses = self.public | {h: a for lan in self.lans for h, a in lan.hosts.items()}
        self.ns = {h: f"{self.tag}-{h}" for h in self.addresses}
        self.routers = {lan.router: f"{self.tag}-{lan.router}" for lan in self.lans}
        names = [*self.public, *(h for lan in self.lans for h in lan.hosts), *self.routers]
        clashes = sorted({n for n in names if names.count(n) > 1} | ({"net"} & set(names)))
        if clashes:
            raise ValueError(f"host and router names must be unique and not 'net': {clashes}")
        long = [n for n in names if len(f"v-{n}") > IFNAMSIZ]
        if long:
            raise ValueError(f"names too long for a device (`v-<name>`, 15 at most): {long}")
        self.made: list[str] = []

    def _add_ns(self, ns: str) -> None:
        sh(*f"ip netns add {ns}".split())
        self.made.append(ns)

    def _plug(self, name: str, ns: str, dev: str, bridge: str, address: str, bits: int) -> None:
        """Device `dev` of namespace `ns` (up, with `address`), its peer `<name>` a port of
        `bridge` (names have no spaces: each command is written as one line and split)."""
        sh(*f"ip -n {self.net} link add {name} type veth peer name {dev} netns {ns}".split())
        sh(*f"ip -n {self.net} link set {name} master {bridge}".split())
        sh(*f"ip -n {self.net} link set {name} up".split())
        sh(*f"ip -n {ns} link set lo up".split())
        sh(*f"ip -n {ns} addr add {address}/{bits} dev {dev}".split())
        sh(*f"ip -n {ns} link set {dev} up".split())

    def _bridge(self, bridge: str) -> None:
        sh(*f"ip -n {self.net} link add {bridge} type bridge".split())
        sh(*f"ip -n {self.net} link set {bridge} up".split())

    def create(self) -> None:
        self._add_ns(self.net)
        self._bridge("br0")
        for host, address in self.public.items():
            self._add_ns(self.ns[host])
            self._plug(f"v-{host}", self.ns[host], "eth0", "br0", address, 24)
        for lan in self.lans:
            router, bridge = self.routers[lan.router], f"b-{lan.router}"
            self._bridge(bridge)
            self._add_ns(router)
            self._plug(f"v-{lan.router}", router, nat.WAN_DEV, "br0", lan.public, 24)
            self._plug(f"r-{lan.router}", router, nat.LAN_DEV, bridge, lan.gateway, lan.prefixlen)
            sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            sh("ip", "netns", "exec", router, "nft", "-f", "-", stdin=nat.ruleset(lan))
            for host, address in lan.hosts.items():
                self._add_ns(self.ns[host])
                self._plug(f"v-{host}", self.ns[host], "eth0", bridge, address, lan.prefixlen)
                sh(*f"ip -n {self.ns[host]} route add default via {lan.gateway}".split())

    def lan_of(self, host: str) -> Lan | None:
        """The LAN `host` sits on, or None for a public host."""
        return next((lan for lan in self.lans if host in lan.hosts), None)

    def dropped(self, router: str) -> int:
        """Packets `router`'s firewall has dropped so far (connections started outside)."""
        ns = self.routers[router]
        listing = sh("ip", "netns", "exec", ns, "nft", "-j", "list", "table", "ip", nat.TABLE)
        return nat.dropped_packets(listing)

    def _ends(self, host: str) -> list[tuple[str, str]]:
        """(namespace, device) of the egress each way: the host's upload, then its download.
        A router's are its public leg's (its LAN's uplink)."""
        ns = self.ns.get(host) or self.routers[host]
        return [(ns, "eth0"), (self.net, f"v-{host}")]

    def shape(self, rate_bits: float | None) -> None:
        """tbf at `rate_bits` on both ends of every host's link; None: a plain pfifo (counts)."""
        for host in self.ns:
            self.shape_host(host, rate_bits, rate_bits)

    def shape_host(self, host: str, up_bits: float | None, down_bits: float | None) -> None:
        """`host`'s link (a host's or a router's public leg) shaped each way on its own: what it
        sends to `up_bits`, what it receives to `down_bits`; None: that way unshaped (a plain
        pfifo, which counts)."""
        for (ns, dev), rate_bits in zip(self._ends(host), (up_bits, down_bits), strict=True):
            if rate_bits is None:
                qdisc = ["pfifo", "limit", "10000"]
            else:
                rate_bytes = rate_bits / 8
                # The bucket holds a whole 64 KiB GSO packet (tbf would split it otherwise) or
                # a hundredth of a second's worth, the larger: the rate holds over any window
                # much longer than that. Up to 100 ms of packets queue behind it.
                burst = max(128 << 10, int(rate_bytes / 100))
                qdisc = f"tbf rate {int(rate_bits)}bit burst {burst} latency 100ms".split()
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)

    def counters(self) -> dict[str, tuple[int, int]]:
        """host -> (bytes sent, bytes received) through its link's root qdiscs, all read at once."""
        calls = [
            (
                host,
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", dev],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                ),
            )
            for host in self.ns
            for ns, dev in self._ends(host)
        ]
        ways: dict[str, list[int]] = {h: [] for h in self.ns}
        for host, proc in calls:
            out, _ = proc.communicate(timeout=CMD_TIMEOUT_S)
            roots = [q for q in json.loads(out or b"[]") if q.get("root")]
            ways[host].append(int(roots[0]["bytes"]) if roots else 0)
        return {h: (v[0], v[1]) for h, v in ways.items()}

    def start(
        self, host: str, name: str, argv: list[str], log_dir: Path, env: dict[str, str], cwd: Path
    ) -> Proc:
        """`argv` run inside `host`'s namespace in a session of its own; output in a log."""
        log_path = log_dir / f"{name}.log"
        with open(log_path, "wb") as out:
            popen = launcher(self.ns[host], argv, out, env, cwd)
        return Proc(name, popen, log_path)

    def destroy(self) -> None:
        """Every namespace made, its processes killed first; the veth pairs, the bridges, the
        routers' forwarding and rulesets live in them and go with them."""
        for ns in reversed(self.made):
            _kill_pids([int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()])
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


@dataclass
class Proc:
    """A child in its own session (process group) inside a namespace; output in `log_path`."""

    name: str
    popen: Child
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> dict[str, str]:
        """The fields of its ready line (`swarm.ops.lifecycle`), once printed before `deadline`."""
        from swarm.ops.lifecycle import parse_ready

        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                fields_ = parse_ready(line)
                if fields_ is not None:
                    return fields_
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in time:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # its own session: pgid == pid
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
