"""Why a dial-back failed, named by its real cause: each cause its own words and its own remedy.

A failed dial-back (`scheduler.reachability`) leaves the dial's error text, and gRPC's texts
mislead: a TLS certificate that does not name the address dialled reads "UNAUTHENTICATED:
Hostname Verification Check failed", the very code a wrong swarm token gets. So the cause is read
off the text (pure, no I/O) and told apart:
- `TLS_NAME`: the peer's certificate does not name what was dialled (its announced host);
- `TLS`: another handshake failure (another CA, expired, TLS on one side only);
- `TOKEN`: the peer refuses the scheduler's swarm token;
- `RELAY_DOWN`: its relay does not answer at all (the relay is down, or cut off);
- `RELAY_REFUSES`: its relay refuses the scheduler's credential for the peer (another token);
- `NOT_ATTACHED`: its relay answers, but the peer is not attached to it;
- `PEER_SILENT`: its relay reached it, and it opened no connection back (its own link, or busy);
- `NO_ANSWER`: nothing answered at its address (nobody can dial it);
- `ERROR`: it answered the call, with an error of its own;
- `NOT_DIALLED`: its address (or its relay's) is private and the scheduler dials only public
  ones (`scheduler.dial_scope`).
Of a peer dialled directly and then through its relay, a refusal by the peer itself (TLS, token)
is the truer cause wherever it came; else the relay's, which is the path a NAT'd peer needs.
"""

from __future__ import annotations

import enum

from scheduler.dial_scope import NOT_DIALLED
from swarm.net import paths

__all__ = ["Cause", "cause_of", "told", "verdict"]


class Cause(enum.Enum):
    TLS_NAME = "TLS name mismatch"
    TLS = "TLS refused"
    TOKEN = "wrong token"
    RELAY_DOWN = "relay down"
    RELAY_REFUSES = "relay refuses the credential"
    NOT_ATTACHED = "not attached to its relay"
    PEER_SILENT = "no answer through its relay"
    NO_ANSWER = "no answer"
    ERROR = "an error"
    NOT_DIALLED = "a private address, not dialled"


# The peer itself refused: wherever it was dialled, this is what is wrong.
_OWN = (Cause.TLS_NAME, Cause.TLS, Cause.TOKEN)

_NAME = ("hostname verification", "no match found for server name", "not in peer certificate")
_NO_CONNECTION = ("unavailable", "deadline_exceeded", "no answer", "oserror", "connection")
_TLS = ("certificate verify failed", "certificate_verify_failed", "handshake", "ssl_error")


def cause_of(error: str, through_relay: bool) -> Cause:
    """The cause of one failed dial whose error text is `error`; `through_relay`: it was dialled
    through a relay (a connection that failed is then the relay's)."""
    text = error.lower()
    if text.startswith(NOT_DIALLED):
        return Cause.NOT_DIALLED
    if any(word in text for word in _NAME):
        return Cause.TLS_NAME
    if through_relay and "response code 407" in text:
        return Cause.RELAY_REFUSES
    if through_relay and "response code 502" in text:
        return Cause.NOT_ATTACHED
    if through_relay and "response code 50" in text:  # 503 full, 504 no connection back
        return Cause.PEER_SILENT
    if any(word in text for word in _TLS):
        return Cause.TLS
    if text.startswith("unauthenticated") or "needs its token" in text:
        return Cause.TOKEN
    if not text.startswith(_NO_CONNECTION):
        return Cause.ERROR  # it answered, with an error of its own
    # A connection that failed: through a relay, the relay's (refused, unreachable, silent);
    # else the peer's own address.
    return Cause.RELAY_DOWN if through_relay else Cause.NO_ANSWER


def verdict(
    address: str, direct: str, relay: str = "", through: str | None = None, peer: str = ""
) -> tuple[Cause, str, str]:
    """(cause, detail, remedy) of a peer announced at `address` that did not answer: `direct`,
    the error of the dial at `address`; `through`, that of the dial through `relay` (None: it
    announces none). The detail begins with the cause, then the errors as they came."""
    causes = [cause_of(direct, through_relay=False)]
    if through is not None:
        causes.append(cause_of(through, through_relay=True))
    own = [c for c in causes if c in _OWN]
    cause = own[0] if own else causes[-1]
    errors = direct if through is None else f"direct: {direct}; through relay {relay}: {through}"
    if cause is Cause.TLS_NAME and through is not None and peer and causes[-1] is cause:
        # Through a relay a peer is verified by its peer id (`swarm.net.paths.peer_name`), not
        # by the address it announces.
        return cause, f"{cause.value}: {errors}", relayed_name_remedy(peer)
    return cause, f"{cause.value}: {errors}", remedy(cause, address, relay)


def relayed_name_remedy(peer: str) -> str:
    """What fixes a relayed peer whose certificate does not name its peer id."""
    return (
        f"its TLS certificate does not name its peer id ({paths.peer_name(peer)}), which callers "
        f"through a relay verify it by: issue it one that does (`swarm certs issue NAME --peer "
        f"{peer}`), or, joined by an invite for NAME, start it with --peer NAME or LABEL.NAME"
    )


def remedy(cause: Cause, address: str, relay: str = "") -> str:
    """What an operator does about a peer at `address` (reached through `relay`) for `cause`."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or address
    if cause is Cause.TLS_NAME:
        return (
            f"its TLS certificate does not name {host}, the host it announces and the "
            f"scheduler dialled: issue it one that does (`swarm certs issue NAME --host {host}`), "
            "or give --announce-host an address its certificate names"
        )
    if cause is Cause.TLS:
        return (
            "its TLS handshake failed (a certificate from another CA, expired, or TLS on one "
            "side only): give it the swarm's CA (--tls-ca) and a current certificate that CA "
            "issued (`swarm certs issue NAME`)"
        )
    if cause is Cause.TOKEN:
        return "it refuses the swarm's token: give it the same --token-file (or SWARM_TOKEN)"
    if cause is Cause.RELAY_DOWN:
        return (
            f"its relay {relay} does not answer: restart the relay (`swarm relay`), or run a "
            "second relay on another reachable host, so a peer behind NAT always has one to "
            "attach to"
        )
    if cause is Cause.RELAY_REFUSES:
        return (
            f"relay {relay} refuses the scheduler's credential for this peer: start the relay "
            "with the swarm's --token-file (or SWARM_TOKEN)"
        )
    if cause is Cause.NOT_ATTACHED:
        return (
            f"the peer is not attached to relay {relay} (it attaches by itself): if this lasts, "
            "its own log says why (its token, its link to the relay)"
        )
    if cause is Cause.PEER_SILENT:
        return (
            f"relay {relay} asked the peer for the call and it opened no connection back: its "
            "own link is down or overloaded; its log says which"
        )
    if cause is Cause.ERROR:
        return "it answered the scheduler's call with an error of its own: its log says why"
    if cause is Cause.NOT_DIALLED:
        return (
            f"{host} is a private address (or its relay's is): give it --announce-host with a "
            "public address, or a relay on a public host; on a swarm within one LAN, start the "
            "scheduler with --dial-private"
        )
    port = port if port.isdigit() else "its port"
    return (
        f"nobody can dial {address}: give the stage server --announce-host with an address "
        f"others reach it at, forward port {port} on its router to it, or start a relay on a "
        "reachable host (`swarm relay`, or a stage server with `--relay`): a peer behind NAT "
        "attaches to one by itself"
    )


# What a peer is told of its own check: a cause only the swarm itself can produce (a certificate
# of the swarm's CA naming another host: any other CA fails the chain first), or one found with
# no dial at all. Every other cause would tell the peer what listens at an address it named
# (closed, HTTP/1, silent, another gRPC server, a swarm server with another token), so it reads
# "no answer" (issue 54, M-scan).
_TOLD = (Cause.TLS_NAME, Cause.NOT_DIALLED)


def told(
    detail: str, fix: str, address: str, relay: str = "", relayed: bool = False
) -> tuple[str, str]:
    """(detail, remedy) of a dial-back's report as the peer, and everyone but the scheduler's own
    log, is told them: the cause's words only, never the dial's error text; a cause of
    `_TOLD` with its remedy `fix`, any other as "no answer" with that one's. `relayed`: the
    detail of a peer reached through its relay ("direct: ERROR"), which has no remedy."""
    if not detail:
        return "", ""
    if relayed:
        cause = cause_of(detail.removeprefix("direct: "), through_relay=False)
        return f"direct: {(cause if cause in _TOLD else Cause.NO_ANSWER).value}", ""
    words = detail.split(": ", 1)[0]
    cause = next((c for c in Cause if c.value == words), Cause.ERROR)
    if cause in _TOLD:
        return cause.value, fix
    return Cause.NO_ANSWER.value, (
        f"{remedy(Cause.NO_ANSWER, address, relay)}; the scheduler's log names the cause"
    )
