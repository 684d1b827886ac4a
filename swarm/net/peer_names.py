"""Which peer ids a certificate certifies, and which names an invite may be issued for: one rule,
used by every check (issues 64 item 8, 68 item 1).

An invite for NAME (`swarm invite NAME`) certifies exactly the peer ids NAME and `LABEL.NAME`,
one label deep under its own name: its certificate carries `NAME.peer.swarm` and
`*.NAME.peer.swarm` (`swarm.net.paths.peer_name`), so a friend's second machine or GPU on the
same invite takes `--peer gpu1.NAME`. It carries no host name: a name others dial directly (the
scheduler's host, the broker's) is an authority, never a friend's to hold.

NAME itself is one label (no '.'), so no two invites' names overlap (an invite for `home` would
otherwise certify `alice.home`'s peer), and it is none of the names that mean something to the
swarm (`RESERVED`): `admin` (the submitters' admin), `scheduler` (under `--tls-mutual` a
certificate so named is a job-API admin; under `--use-identity-as-username` the broker's
scheduler user), a relay's id (`relay`, `relay-…`) or an MQTT client id's form (`peer-…`).
Anything under `peer.swarm` has a dot, so it is refused with every other dotted name: `swarm
invite peer.swarm` would have carried `*.peer.swarm`, which passed TLS as every relayed peer.

A certificate certifies peer P (`certifies`) when it names `P.peer.swarm`, or when it names
`*.PARENT.peer.swarm` and P is one label under PARENT: TLS's own wildcard rule, which callers
through a relay verify a peer by (`swarm.net.dial`), except that a wildcard directly under
`peer.swarm` certifies nobody. The relay's attach check (`swarm.relay.identity`), a stage
server's check of its own certificate at start (`stage_server.peer.certificate`), `--join`'s
choice of a second process's id (`swarm.net.invite`) and the embedded broker's users under
`--use-identity-as-username` (`swarm.bus.gate`) all ask `certifies` or `own_id`.

Where the broker binds peer ids to certificates that way, a ban binds the credential, not only
the id (`credentials_of`, `barred`): peer P may have been announced by a certificate named P or
named P's parent (`gpu1.alice`: `alice`'s invite), and each of those certifies its own name
and every id one label under it. So a ban of `gpu1.alice` bars `alice`, `LABEL.alice` and
`LABEL.gpu1.alice`: the liar's invite cannot come back under a new id (issue 64). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from swarm.errors import ConfigError
from swarm.net.paths import PEER_DOMAIN, peer_name

__all__ = [
    "RESERVED",
    "BarredIds",
    "barred",
    "certified_ids",
    "certifies",
    "check_invite_name",
    "credentials_of",
    "invite_names",
    "own_id",
]

RESERVED = ("admin", "scheduler", "relay")
"""Names an invite is never issued for: each is an authority somewhere in the swarm."""
_RESERVED_PREFIXES = ("relay-", "peer-")  # a relay's id (`relay-HOST-PORT`); an MQTT client id
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SUFFIX = "." + PEER_DOMAIN


def check_invite_name(name: str) -> str:
    """`name`, or a ConfigError saying why no invite may be issued for it."""
    if not _LABEL.fullmatch(name):
        raise ConfigError(
            f"invite name {name[:80]!r}: use one label of 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit, and no '.': an invite for NAME also certifies "
            "LABEL.NAME (a second machine's peer id), so a dotted name would overlap another's"
        )
    lowered = name.lower()
    if lowered in RESERVED or lowered.startswith(_RESERVED_PREFIXES):
        raise ConfigError(
            f"invite name {name!r} is reserved (admin, scheduler, relay, relay-…, peer-…: each "
            "names an authority or another role in the swarm): choose the friend's own name"
        )
    return name


def invite_names(name: str) -> list[str]:
    """The DNS names an invite's certificate for `name` carries: its peer id's and the
    wildcard of its second processes' (`gpu1.NAME`)."""
    return _names(check_invite_name(name))


def _names(name: str) -> list[str]:
    own = peer_name(name)
    return [own, f"*.{own}"]


def certifies(dns_names: Iterable[str], peer: str) -> bool:
    """Whether a certificate whose DNS names are `dns_names` certifies peer id `peer`."""
    try:
        wanted = peer_name(peer)
    except ValueError:
        return False
    names = {n.lower().rstrip(".") for n in dns_names}
    if wanted in names:
        return True
    _, dot, parent = wanted.partition(".")
    # A wildcard one label above: never `*.peer.swarm` itself, which would be every peer.
    return bool(dot) and parent != PEER_DOMAIN and f"*.{parent}" in names


def certified_ids(dns_names: Iterable[str]) -> list[str]:
    """The peer ids `dns_names` certify, in words (`alice`, `LABEL.alice`), for messages."""
    ids = []
    for name in (n.lower().rstrip(".") for n in dns_names):
        if not name.endswith(_SUFFIX):
            continue
        peer = name.removesuffix(_SUFFIX)
        if peer.startswith("*.") and peer[2:]:
            ids.append(f"LABEL.{peer[2:]}")
        elif peer and "*" not in peer:
            ids.append(peer)
    return ids


def own_id(peer: str, name: str) -> bool:
    """Whether peer id `peer` is one an invite for `name` certifies: `name` or `LABEL.name`
    (an invite read, not issued: its name is not checked again here)."""
    return certifies(_names(name), peer)


def credentials_of(peer: str) -> frozenset[str]:
    """The certificate names that may have announced peer id `peer` where ids are bound to
    certificates (`own_id`): its own, and its parent's (`alice` for `gpu1.alice`)."""
    name = peer.lower()
    _, dot, parent = name.partition(".")
    return frozenset({name, parent}) if dot and parent else frozenset({name})


def barred(peer: str, credentials: Iterable[str]) -> bool:
    """Whether peer id `peer` is one a certificate named in `credentials` certifies (the ids
    of a banned credential: `credentials_of`)."""
    name = peer.lower()
    held = set(credentials)
    return name in held or name.partition(".")[2] in held - {""}


class BarredIds:
    """The peer ids a job's bans bar: each banned id, and where ids bind credentials
    (`binds_credentials`) every id a banned one's credential certifies (`barred`). One rule for
    the coordinator's members and the scheduler's placement: placement that read the banned ids
    alone gave a banned invite's new id a stage its coordinator would never count."""

    def __init__(self, binds_credentials: bool, banned: Iterable[str] = ()) -> None:
        self.binds_credentials = binds_credentials
        self._ids: set[str] = set()
        self._credentials: set[str] = set()
        for peer in banned:
            self.add(peer)

    def add(self, peer: str) -> None:
        """`peer` is banned from now on."""
        self._ids.add(peer)
        if self.binds_credentials:
            self._credentials |= credentials_of(peer)

    def __contains__(self, peer: object) -> bool:
        if not isinstance(peer, str):
            return False
        return peer in self._ids or (self.binds_credentials and barred(peer, self._credentials))

    def __bool__(self) -> bool:
        return bool(self._ids)
