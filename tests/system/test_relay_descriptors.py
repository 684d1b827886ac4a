"""M-fill (issue 54): a token holder's self-tunnels do not take a relay process's last descriptor.
`swarm relay` runs with 256 descriptors, hard limit included (the issue's 1,024 scaled down: a
quarter of the tunnels, the same exhaustion); a peer of the swarm attaches made-up ids and opens
tunnels to them from its own machine, its made-up peers answering each with a data connection.
Before: 128 such tunnels took every descriptor, and the real peer's calls were refused."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.local.procs import SwarmProcess
from swarm.net.paths import relay_credential
from swarm.relay.auth import data_proof
from tests.support.relays import NAT_HOST, Stream, echo_bytes, home_peer, raw_attach

TOKEN = "relay-descriptors-token"
ELSEWHERE = "127.0.0.2"
NOFILE = 256
pytestmark = pytest.mark.timeout(180)


# The relay's Python limits itself, then becomes the relay (exec): not a `preexec_fn`, which
# makes `subprocess` fork this process, whose gRPC restarts its poller in the child, where
# `close_fds` closes the poller's epoll descriptor before the exec: the child aborted, one run
# in many ("epoll_wait error: Bad file descriptor", grpc/grpc#43055).
_LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def _nofile(pid: int) -> tuple[int, int]:
    """Process `pid`'s descriptor limits (soft, hard)."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    return soft, hard


def _start_relay(log_dir: Path) -> SwarmProcess:
    args = ["relay", "--host", "127.0.0.1", "--port", "0"]
    log_path = log_dir / "relay.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LIMITED, str(NOFILE), "-m", "swarm.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_TOKEN": TOKEN},
        )
    return SwarmProcess(args, proc, log_path)


async def _made_up_peer(relay: str, control: Stream, held: list[Stream]) -> None:
    """Answers the relay's pings, and each call with a data connection it holds."""
    host, port = relay.rsplit(":", 1)
    reader, writer = control
    with contextlib.suppress(ConnectionError, OSError):
        while line := await reader.readline():
            verb, _, rest = line.decode().strip().partition(" ")
            if verb == "PING":
                writer.write(b"PONG\n")
            elif verb == "OPEN":
                call = rest.split(" ")[0]
                with contextlib.suppress(OSError):
                    data = await asyncio.open_connection(host, int(port), local_addr=(ELSEWHERE, 0))
                    data[1].write(
                        f"DATA {call} SWARM-RELAY/1\r\nAuthorization: Swarm "
                        f"{data_proof(TOKEN, call)}\r\n\r\n".encode()
                    )
                    held.append(data)


async def _tunnel(relay: str, peer: str, held: list[Stream]) -> bool:
    """A tunnel to `peer` opened and held: whether the relay carried it."""
    host, port = relay.rsplit(":", 1)
    try:
        stream = await asyncio.open_connection(host, int(port), local_addr=(ELSEWHERE, 0))
        held.append(stream)
        login = base64.b64encode(f"{peer}:{relay_credential(TOKEN, peer)}".encode()).decode()
        stream[1].write(
            f"CONNECT {NAT_HOST}:1 HTTP/1.1\r\nProxy-Authorization: Basic {login}\r\n\r\n".encode()
        )
        return (await asyncio.wait_for(stream[0].readline(), 5)).startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False


@pytest.mark.attack("M-fill")
async def test_self_tunnels_leave_the_relay_descriptors_for_the_real_peer(tmp_path: Path) -> None:
    relay = _start_relay(tmp_path)
    held: list[Stream] = []
    peers: list[asyncio.Task[None]] = []
    try:
        address = (await asyncio.to_thread(relay.wait_ready, 60))["address"]
        assert _nofile(relay.proc.pid) == (NOFILE, NOFILE), "the relay runs with its 256"
        made_up = [f"made-up-{i}" for i in range(4)]
        for peer in made_up:
            answer, control = await raw_attach(address, peer, TOKEN, source=ELSEWHERE)
            held.append(control)
            if answer == "OK":
                peers.append(asyncio.create_task(_made_up_peer(address, control, held)))
        # One after the other until the relay carries no more: each one carried holds two of
        # its descriptors for as long as the attacker likes.
        for i in range(NOFILE // 2):
            if not await _tunnel(address, made_up[i % len(made_up)], held):
                break
        async with home_peer(address, TOKEN) as (_, relayed):
            for i in range(5):
                assert await echo_bytes(relayed, TOKEN, [b"%d" % i]) == [b"%d" % i]
        assert relay.proc.poll() is None, relay.log
    finally:
        for task in peers:
            task.cancel()
        for _, writer in held:
            writer.close()
        relay.kill()
