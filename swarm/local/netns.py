"""Hosts of their own on one machine: a network namespace per host, each with its own address on
one bridge, optionally with a tbf-shaped link (root only; `netem` is not needed). The WAN
benchmark (`bench/wan.py`) and the many-hosts test (`tests/system/test_many_hosts.py`) build their
swarms on it; everything is created and removed by the run that made it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Network", "Proc", "available", "remove_leftovers", "sh"]

CMD_TIMEOUT_S = 30.0  # one `ip` or `tc` call


def sh(*cmd: str, check: bool = True) -> str:
    """Run one command (bounded); its stdout. A failure raises with its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
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
    (SIGKILL first any process still in them): a run killed before it cleaned up. A namespace
    of a run still going is left alone."""
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
    port of bridge `br0` in the network's own namespace. Names are `<prefix><pid>-<host>`."""

    def __init__(self, prefix: str, addresses: Mapping[str, str]) -> None:
        self.tag = f"{prefix}{os.getpid()}"
        self.net = f"{self.tag}-net"
        self.addresses = dict(addresses)  # host -> its IPv4 address, all in one /24
        self.ns = {h: f"{self.tag}-{h}" for h in addresses}
        self.made: list[str] = []

    def create(self) -> None:
        """Every name has no spaces, so each command is written as one line and split."""
        sh(*f"ip netns add {self.net}".split())
        self.made.append(self.net)
        sh(*f"ip -n {self.net} link add br0 type bridge".split())
        sh(*f"ip -n {self.net} link set br0 up".split())
        for host, ns in self.ns.items():
            sh(*f"ip netns add {ns}".split())
            self.made.append(ns)
            port = f"v-{host}"
            sh(*f"ip -n {self.net} link add {port} type veth peer name eth0 netns {ns}".split())
            sh(*f"ip -n {self.net} link set {port} master br0".split())
            sh(*f"ip -n {self.net} link set {port} up".split())
            sh(*f"ip -n {ns} link set lo up".split())
            sh(*f"ip -n {ns} addr add {self.addresses[host]}/24 dev eth0".split())
            sh(*f"ip -n {ns} link set eth0 up".split())

    def _ends(self, host: str) -> list[tuple[str, str]]:
        """(namespace, device) of the egress each way: the host's upload, then its download."""
        return [(self.ns[host], "eth0"), (self.net, f"v-{host}")]

    def shape(self, rate_bits: float | None) -> None:
        """tbf at `rate_bits` on both ends of every host's link; None: a plain pfifo (counts)."""
        for host in self.ns:
            for ns, dev in self._ends(host):
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
            popen = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        return Proc(name, popen, log_path)

    def destroy(self) -> None:
        for ns in reversed(self.made):
            _kill_pids([int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()])
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


@dataclass
class Proc:
    """A child in its own session (process group) inside a namespace; output in `log_path`."""

    name: str
    popen: subprocess.Popen[bytes]
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
