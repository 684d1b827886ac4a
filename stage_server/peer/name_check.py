"""`swarm doctor`'s name check: the broker's and the scheduler's host names, looked up as every
dial will look them up, before either is called (issue 68 item 7). A slow resolver spends a
call's whole deadline on the lookup, and the doctor then said the scheduler "does not answer …
start the scheduler" while the broker on the same host had passed; a name that does not
resolve in time is now its own finding, with the resolver's fix, and the calls to that host are
not made (their failure would blame the server).

The lookup goes through a `Resolver`, so a test gives a slow one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from typing import Protocol

from stage_server.peer.network_checks import Check
from swarm.bus.topics import parse_broker_url

__all__ = ["SLOW_S", "Resolver", "SystemResolver", "host_of", "name_check"]

# A lookup slower than this passes, but says so: each dial pays it again.
SLOW_S = 1.0

RESOLVER_FIX = (
    "this machine's name lookups are slow or failing: check its resolver (`resolvectl status`, "
    "/etc/resolv.conf, a VPN's DNS), or give the host as an IP address (--scheduler, --broker, "
    "or the invite's), or allow more time (--timeout)"
)


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """The addresses `host` names; raises OSError when it names none."""
        ...


class SystemResolver:
    """The system's resolver (getaddrinfo, as gRPC's and the broker's dials use it), in a thread
    of its own that the doctor does not wait for: a lookup that hangs past the check's timeout
    must not hold the process at its exit, as the event loop's executor would."""

    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[str]] = loop.create_future()

        def settle(addresses: list[str] | None, error: OSError | None) -> None:
            if answer.done():  # the check gave up on it
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(addresses or [])

        def look_up() -> None:
            try:
                found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                loop.call_soon_threadsafe(settle, None, e)
                return
            loop.call_soon_threadsafe(settle, sorted({str(f[4][0]) for f in found}), None)

        threading.Thread(target=look_up, name=f"resolve {host}", daemon=True).start()
        return await answer


def host_of(address: str) -> tuple[str, int] | None:
    """The host name and port of a broker URL or a HOST:PORT; None for an IP address (nothing
    to look up) or an address that does not parse (the call's own check names that)."""
    try:
        if "://" in address:
            url = parse_broker_url(address)
            host, port = url.host, url.port
        else:
            name, _, digits = address.rpartition(":")
            host, port = name, int(digits)
    except ValueError:
        return None
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return (host, port) if host else None
    return None


async def name_check(host: str, port: int, resolver: Resolver, timeout: float) -> Check:
    """`host` looked up within `timeout`: the addresses it names and how long it took."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            addresses = await resolver.resolve(host, port)
    except TimeoutError:
        found = f"{host} did not resolve within {timeout:g} s (a slow or unreachable resolver)"
        return Check("name", False, found, RESOLVER_FIX)
    except OSError as e:
        found = f"{host} does not resolve ({e})"
        fix = f"check the host name (a typo in --scheduler, --broker, the invite?); {RESOLVER_FIX}"
        return Check("name", False, found, fix)
    took = time.monotonic() - start
    slow = f", but slowly ({took:.1f} s): every dial pays it" if took > SLOW_S else ""
    return Check("name", True, f"{host} resolves to {', '.join(addresses)}{slow}")
