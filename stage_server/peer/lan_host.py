"""A peer behind NAT serves on its own LAN address, found by itself (issue 68 item 2).

A friend's machine, joined by an invite (`--join`, implying `--behind-nat`), is given no `--host`
nor `--announce-host`: it listened on 127.0.0.1 and announced that, so its neighbour behind the
same router had no address to try (`swarm.rpc.lan`) and every hop between two machines of one
home went out to the relay and back. Now a peer behind NAT left on the default host takes the
source address of its route to the broker when that is a private one
(`swarm.net.addresses.lan_address`): it listens there, and announces it. Behind NAT that address
is only ever the LAN shortcut's: callers elsewhere reach the peer through its relay, the
scheduler dials no private address (unless `--dial-private`), and the failure domain a peer is
placed by is the public address its relay saw, never this one. Only with a token: a port open
on the LAN without one would take anyone's calls (`swarm.net.tokens.refuse_open_host`).
"""

from __future__ import annotations

import logging

from swarm.bus.topics import parse_broker_url
from swarm.net.addresses import lan_address

__all__ = ["DEFAULT_HOST", "serving_host"]

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # `--host`'s default (`stage_server.peer.flags`)


def serving_host(
    host: str, announce_host: str, *, behind_nat: bool, broker: str, token: str | None
) -> str:
    """The host to listen on and announce: `host` as given, except a peer behind NAT left on
    `DEFAULT_HOST` with no `announce_host`, which takes its LAN address when it has one."""
    if not behind_nat or host != DEFAULT_HOST or announce_host or not broker:
        return host
    try:
        toward = parse_broker_url(broker).host
    except ValueError:
        return host  # said by the bus when it dials: nothing to add here
    found = lan_address(toward)
    if not found:
        log.info(
            "behind NAT: no private address of this machine routes to %s; listening on %s only "
            "(calls arrive through the relay)",
            toward,
            host,
        )
        return host
    if not token:
        log.info(
            "behind NAT: not listening on this machine's LAN address %s without a swarm token "
            "(anyone on the LAN could call it); listening on %s only",
            found,
            host,
        )
        return host
    log.info(
        "behind NAT: listening on this machine's LAN address %s, so that peers behind the same "
        "router call it directly (others, through the relay)",
        found,
    )
    return found
