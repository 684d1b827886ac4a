"""What a peer says of its path (`stage_server.peer.reachability.PeerPath`): the scheduler's
report of how it is reached, and its relay's loss, in the log's words.

A peer on its way to a relay is not in trouble (issue 68 item 4): behind NAT the scheduler's first
dial-back judges the address it announced before it attached (a private one, not dialled), and
that report arrives after the attachment or while a relay is there to attach to. It is said as
"attaching via relay X" at INFO, not as a warning whose fix (`--announce-host`, a forwarded port)
is wrong for it. A report that judged it through its relay and still found nothing is trouble,
and says its remedy at WARNING.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from swarm.proto import control_pb2 as cpb

__all__ = ["relay_gone", "remedy", "say_report"]

log = logging.getLogger("stage_server.peer.reachability")  # the lifecycle lines' logger


def say_report(
    peer: str,
    report: cpb.ReachabilityReport,
    own: str,
    relay: str,
    relays: Sequence[str],
) -> None:
    """Log `report` for `peer`, announced at `own`, attached to `relay` ("": none), the relays
    announced now being `relays`."""
    address = report.address or own
    if report.reachability == cpb.REACHABILITY_DIRECT:
        log.info("%s: reachable at %s (direct)", peer, address)
    elif report.reachability == cpb.REACHABILITY_RELAYED:
        log.info(
            "%s: relayed through %s (%s does not answer directly)",
            peer,
            report.relay or relay,
            address,
        )
    elif report.reachability == cpb.REACHABILITY_UNREACHABLE:
        detail = report.detail.rstrip(". ") or "the scheduler's dial-back got no answer"
        via = relay or (relays[0] if relays else "")
        if via and report.relay != via:
            # Judged before it was reached through this relay (the usual start behind NAT: the
            # address it announced first, not dialled): it is attached, or attaches next
            # (`PeerPath.steer`), and the scheduler dials it there next.
            log.info(
                "%s: attaching via relay %s (%s is not dialled directly: %s)",
                peer,
                via,
                address,
                detail,
            )
            return
        log.warning(
            "%s: not reachable at %s: %s. %s",
            peer,
            address,
            detail,
            report.remedy or remedy(own),
        )


def relay_gone(peer: str, relay: str) -> None:
    log.warning(
        "%s: relay %s is gone and no other relay answers: announced without a relay, so "
        "nobody can call this peer until a relay (a reachable stage server started with "
        "--relay, or `swarm relay`) is announced",
        peer,
        relay or "(none)",
    )


def remedy(address: str) -> str:
    """What makes a peer announced at `address` reachable, when the report names nothing."""
    port = address.rsplit(":", 1)[-1]
    return (
        f"Forward TCP port {port} of your router to this machine and give --announce-host "
        "with the router's public address (--host 0.0.0.0 to listen on every interface), or "
        "let it be reached through a relay: a reachable stage server started with --relay "
        "(this peer attaches to one by itself; --behind-nat attaches at its start)"
    )
