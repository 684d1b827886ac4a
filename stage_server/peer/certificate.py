"""A stage server's own certificate, checked at start against what its callers will verify it by:
its announced host when they dial it directly, its peer id (`swarm.net.paths.peer_name`,
`PEER.peer.swarm`) when they reach it through a relay (behind NAT, its announced address is
private or loopback, the same in many homes, so it names nobody). A certificate that names
neither, or a peer started `--behind-nat` whose certificate does not name its id, would have every
call refused in the handshake while its own log looked healthy: it stops at start, with the
`swarm certs issue` line that fixes it (the scheduler checks its own the same way,
`swarm.net.tls.Tls.check_names`)."""

from __future__ import annotations

import ipaddress
import logging

from swarm.errors import ConfigError
from swarm.net.paths import peer_name
from swarm.net.peer_names import certified_ids, certifies
from swarm.net.tls import Tls

__all__ = ["check_own_certificate"]

log = logging.getLogger(__name__)


def check_own_certificate(identity: Tls | None, host: str, peer: str, behind_nat: bool) -> None:
    """ConfigError, naming the fix, when `identity`'s certificate names neither the announced
    `host` nor `peer` (nor `peer` under `behind_nat`); nothing without a certificate, or with one
    that names nothing (left to the handshake)."""
    if identity is None or identity.cert is None:
        return
    name = peer_name(peer)
    direct, sans = identity.names(host), identity.subject_names()
    if direct is None or sans is None:
        return
    # The one rule the relay and callers hold it to (`swarm.net.peer_names`): `*.peer.swarm`
    # certifies no peer, `*.alice.peer.swarm` certifies `gpu1.alice`.
    relayed = certifies(sans[0], peer)
    host = host.strip("[]")
    theirs = [i for i in certified_ids(sans[0]) if not i.startswith("LABEL.")]
    if theirs and not relayed:  # issued for a peer id: most likely --peer was left out
        fix = f"start it with --peer {theirs[0]}, the peer id its certificate names"
    else:
        # A loopback host names every machine, never worth a certificate; behind NAT nobody
        # dials the host it announces.
        also = "" if behind_nat or _loopback(host) else f" --host {host}"
        direct_too = " and, if others may dial it directly, that host" if also else ""
        fix = (
            f"issue it one that names its peer id (reached through a relay){direct_too}: "
            f"`swarm certs issue NAME --peer {peer}{also}`, and start it with --peer {peer}"
        )
    names = f"--tls-cert {identity.cert_path} names {identity.named()}"
    if behind_nat and not relayed:
        raise ConfigError(
            f"{names}, not peer {peer} ({name}): behind NAT (--behind-nat) this stage server is "
            f"reached through a relay, where callers verify it by its peer id, and would refuse "
            f"it: {fix}"
        )
    if not direct and not relayed:
        raise ConfigError(
            f"{names}: neither {host}, the host it announces (--announce-host), nor peer {peer} "
            f"({name}), what callers through a relay verify it by: every call to it would be "
            f"refused: {fix}"
        )
    if not relayed:
        log.info(
            "%s: its certificate names %s, not its peer id (%s): it is dialled directly only; "
            "behind NAT, through a relay, callers would refuse it (`swarm certs issue NAME "
            "--peer %s`)",
            peer,
            host,
            name,
            peer,
        )
    elif not direct:
        log.info(
            "%s: its certificate names its peer id (%s), not %s: callers reach it through a relay",
            peer,
            name,
            host,
        )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"
