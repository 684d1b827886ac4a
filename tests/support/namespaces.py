"""Hosts of their own for one test: network namespaces (`swarm.local.netns`) made for it and
removed after it, with what a run killed before it cleaned up left behind removed first; with
`lans`, private LANs behind NAT routers (`swarm.local.nat`). And a TCP probe to run between
them: `listen` on one host, `dial` from another (does the connection open, whom does the
listener see, how long do N bytes take each way). And a `Looker`: one process on a host that
tells a job's status each time it is asked. And `tally`: nftables counters of the bytes arriving
at a host, by source (`tallied` reads them)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from swarm.local import netns

__all__ = [
    "PROXIES",
    "ROOT",
    "Dialed",
    "Looker",
    "dial",
    "host_env",
    "listen",
    "network",
    "network_sweep",
    "run_on",
    "scheduler_args",
    "seen_peers",
    "swarm_argv",
    "swarm_env",
    "tallied",
    "tally",
]

PROXIES = {"http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "no_proxy"}
"""Variables (any case) a process in a namespace must not have: gRPC would dial through them."""
ROOT = Path(__file__).resolve().parents[2]


def scheduler_args(host: str, work: Path, data_root: Path) -> tuple[str, ...]:
    """`swarm scheduler`'s arguments on a public host at `host`: gRPC on 7700, its embedded
    broker on 1883, its store and checkpoints under `work`."""
    return (
        *("scheduler", "--host", "0.0.0.0", "--announce-host", host, "--port", "7700"),
        *("--broker-port", "1883", "--store", str(work / "jobs.sqlite")),
        *("--checkpoint-dir", str(work / "ckpt"), "--data-root", str(data_root)),
        "--dial-private",  # the namespaces' addresses are private and documentation ranges
    )


def swarm_argv(*args: str) -> list[str]:
    """`swarm ARGS` as this interpreter runs it, logging at INFO."""
    return [sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]


def _env(cache: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a `swarm` process in a namespace: none of this one's `SWARM_*`
    variables nor proxies, this checkout importable, peers measuring into `cache`; and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env = {k: v for k, v in env.items() if k.lower() not in PROXIES}
    return env | {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
        "SWARM_CACHE_DIR": str(cache),
        **extra,
    }


def host_env(work: Path, host: str, **extra: str) -> dict[str, str]:
    """The environment of a swarm process on `host`, its cache directory of its own under
    `work`; and `extra`."""
    return _env(work / f"cache-{host}", extra)


def swarm_env(token: str, cache: Path, **more: str) -> dict[str, str]:
    """The environment of a swarm process with the swarm's `token`, measuring into `cache`; and
    `more` (names as given)."""
    return _env(cache, {"SWARM_TOKEN": token, **more})


def run_on(net: netns.Network, host: str, argv: list[str], env: dict[str, str]) -> str:
    """`argv` run to its end on `host` (the test's own namespace reaches nobody), from this
    checkout; its stdout (asserted to succeed)."""
    done = subprocess.run(
        ["ip", "netns", "exec", net.ns[host], *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def maker_alive(pid: int) -> bool:
    """Whether `pid`, the maker named in a lab's namespaces, is still a test process running: a
    Python interpreter (pytest, or one of its xdist workers, whose command line does not name
    pytest: it counted as gone, and a worker removed the other's labs mid-test). A pid reused
    by another program counts as gone; one reused by another Python only keeps a leftover for a
    later sweep."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:  # no such process, or a zombie (its executable is gone with it)
        return False


def network_sweep(prefix: str) -> list[str]:
    """What a lab of `prefix` removes as it starts: the namespaces of runs killed before they
    cleaned up (`netns.remove_leftovers`), whichever test or worker made them."""
    return netns.remove_leftovers(prefix, maker_alive)


@contextlib.contextmanager
def network(
    prefix: str, addresses: Mapping[str, str], lans: Sequence[netns.Lan] = ()
) -> Iterator[netns.Network]:
    """A namespace per host of `addresses`, on one bridge, and each of `lans` behind its router;
    the test is skipped where namespaces (or, with `lans`, nftables) cannot be made (not root:
    CI runs as root and installs nftables, so there it always runs)."""
    problem = netns.available(routers=bool(lans))
    if problem:
        pytest.skip(problem)
    network_sweep(prefix)
    net = netns.Network(prefix, addresses, lans)
    try:
        net.create()
        yield net
    finally:
        net.destroy()


# The probe. A connection starts with 16 bytes: how many the dialer sends, how many it wants
# back. The listener prints each dialer's address, reads what it is sent, then sends what is
# wanted and closes; the dialer times from the connection's opening to the last byte back, so
# an upload is timed through its acknowledgement.
_LISTEN = """
import contextlib, socket, struct, sys, threading
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("swarm probe ready: port=" + sys.argv[1], flush=True)
def read(conn, n):
    parts = []
    while n > 0:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)
def serve(conn):
    with conn, contextlib.suppress(EOFError, OSError):
        send, want = struct.unpack("!QQ", read(conn, 16))
        read(conn, send)
        conn.sendall(bytes(want))
while True:
    conn, peer = srv.accept()
    print("peer " + peer[0], flush=True)
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
_DIAL = """
import json, socket, struct, sys, time
host, (port, send, want), timeout = sys.argv[1], map(int, sys.argv[2:5]), float(sys.argv[5])
try:
    conn = socket.create_connection((host, port), timeout=timeout)
except OSError as e:
    print(json.dumps({"ok": False, "error": str(e) or type(e).__name__}))
    sys.exit()
conn.settimeout(120)
t0 = time.monotonic()
conn.sendall(struct.pack("!QQ", send, want) + bytes(send))
got = 0
while got < want:
    got += len(conn.recv(1 << 20) or sys.exit("closed early"))
print(json.dumps({"ok": True, "seconds": time.monotonic() - t0}))
"""


@dataclass(frozen=True)
class Dialed:
    ok: bool  # the connection opened (and the bytes went both ways)
    seconds: float  # from its opening to the last byte back
    error: str  # why it did not open ("timed out", "Connection refused", ...)


def listen(net: netns.Network, host: str, port: int, log_dir: Path) -> netns.Proc:
    """A probe listener on `host`, all its addresses, `port`; ready when this returns."""
    argv = [sys.executable, "-c", _LISTEN, str(port)]
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    proc = net.start(host, f"probe-{host}-{port}", argv, log_dir, env, log_dir)
    proc.wait_ready(time.monotonic() + 30)
    return proc


def seen_peers(listener: netns.Proc) -> list[str]:
    """The address each connection to `listener` came from, in order."""
    return [line.split()[1] for line in listener.log().splitlines() if line.startswith("peer ")]


def dial(
    net: netns.Network,
    host: str,
    address: str,
    port: int,
    *,
    send: int = 0,
    want: int = 1,
    timeout: float = 3.0,
) -> Dialed:
    """From `host`, a connection to `address:port` (given up after `timeout` s) that sends `send`
    bytes and takes `want` back."""
    argv = [sys.executable, "-c", _DIAL, address, str(port), str(send), str(want), str(timeout)]
    done = subprocess.run(
        ["ip", "netns", "exec", net.ns[host], *argv],
        capture_output=True,
        text=True,
        timeout=timeout + 150,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the probe from {host} failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    return Dialed(out["ok"], out.get("seconds", 0.0), out.get("error", ""))


# The looker: one `JobStatus` a line asked on stdin (a job id), answered on stdout as the document
# `swarm status --json` prints, on one line; the process's own token (SWARM_TOKEN) and identity
# (SWARM_TLS_*), as the CLI takes them. Unanswered, asked 3 times (`tests.support.status.ASKS`).
_LOOK = """
import asyncio, json, os, sys
from google.protobuf import json_format
from client.sdk import ClientError, SchedulerClient
async def main():
    token = os.environ.get("SWARM_TOKEN") or None
    async with SchedulerClient(sys.argv[1], token=token) as client:
        for line in sys.stdin:
            for ask in range(3):
                try:
                    status = await client.get(line.strip())
                    break
                except ClientError as e:
                    if not e.unanswered or ask == 2:
                        raise
                    await asyncio.sleep(0.2)
            doc = json_format.MessageToDict(
                status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            print(json.dumps(doc), flush=True)
asyncio.run(main())
"""


class Looker:
    """A job's status asked from `host` as `swarm status --json` would, by one process that
    stays: a `swarm status` per look started an interpreter each time (1-3 s on a busy machine,
    CPU the swarm under test waited for; a test holding its job still while it looked held it
    that long). `look` fails when the scheduler did not answer, as the command would."""

    def __init__(self, net: netns.Network, host: str, scheduler: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", net.ns[host], sys.executable, "-c", _LOOK, scheduler],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            text=True,
        )

    def look(self, job_id: str) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(job_id + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"the looker exited with {self._proc.wait()}"
        doc: dict[str, Any] = json.loads(line)
        return doc

    def close(self) -> None:
        self._proc.kill()
        self._proc.communicate()  # reaped, its pipes closed


TALLY = "swarm_tally"  # the counting table `tally` makes in a host's namespace


def tally(
    net: netns.Network,
    host: str,
    rules: Mapping[str, str],
    by_connection: Mapping[str, str] | None = None,
) -> None:
    """Count, in `host`'s namespace, the bytes arriving that match each of `rules` (a name: an
    nftables match, e.g. `ip saddr 192.168.1.11 tcp dport 7000`), read by `tallied`; and those
    matching each of `by_connection`, by connection (the port of `host`'s end), read by
    `tallied_by_connection`."""
    sets = "".join(
        f"  set {name} {{ type inet_service; flags dynamic; counter; }}\n"
        for name in by_connection or {}
    )
    lines = "".join(f'    {match} counter comment "{name}"\n' for name, match in rules.items())
    lines += "".join(
        f"    {match} add @{name} {{ tcp dport }}\n"
        for name, match in (by_connection or {}).items()
    )
    table = (
        f"table ip {TALLY} {{\n{sets}  chain input {{\n"
        "    type filter hook input priority filter; policy accept;\n"
        f"{lines}  }}\n}}\n"
    )
    netns.sh("ip", "netns", "exec", net.ns[host], "nft", "-f", "-", stdin=table)


def tallied_by_connection(net: netns.Network, host: str, name: str) -> dict[int, int]:
    """The bytes counted so far by `tally`'s `by_connection` match `name` in `host`'s
    namespace, by connection (the port of `host`'s end)."""
    listing = netns.sh(
        "ip", "netns", "exec", net.ns[host], "nft", "-j", "list", "set", "ip", TALLY, name
    )
    found = [item["set"] for item in json.loads(listing)["nftables"] if "set" in item]
    return {
        int(element["elem"]["val"]): int(element["elem"]["counter"]["bytes"])
        for element in found[0].get("elem", [])
    }


def tallied(net: netns.Network, host: str) -> dict[str, int]:
    """The bytes counted so far by `tally`'s rules in `host`'s namespace, by rule name."""
    listing = netns.sh(
        "ip", "netns", "exec", net.ns[host], "nft", "-j", "list", "table", "ip", TALLY
    )
    counted: dict[str, int] = {}
    for item in json.loads(listing)["nftables"]:
        rule = item.get("rule", {})
        for expr in rule.get("expr", []):
            if "counter" in expr:
                counted[rule["comment"]] = int(expr["counter"]["bytes"])
    return counted
