"""Submitter tokens: who submitted a job, so that only they (or an admin) may cancel, delete or
export it.

The scheduler holds one secret, the admin token (`swarm scheduler --admin-token-file`). A
submitter's token is derived from it and the submitter's name, `NAME:HMAC-SHA256(admin, NAME)`
(`submitter_token`, `swarm submitter-token NAME`), so the scheduler checks one without a list of
names to keep, reload or leak: it recomputes the digest (`submitter_of`). The admin's own
credential is derived the same way, under the reserved name `admin` (`admin_credential`,
`swarm submitter-token admin`): the admin token, the root of every token, never travels, so a
credential seen on the wire (without TLS) makes no other (issue 54). A client sends its token
beside the swarm token, under `SUBMITTER_KEY`. A name cannot be
revoked alone: rotating the admin token voids every submitter token, as the swarm's certificates
have no revocation either (docs/decisions.md, "Who submitted a job").
"""

from __future__ import annotations

import hashlib
import hmac
import re

from swarm.errors import ConfigError

__all__ = [
    "ADMIN",
    "SUBMITTER_KEY",
    "SUBMITTER_NAME_RE",
    "admin_credential",
    "check_submitter_name",
    "is_admin_token",
    "submitter_of",
    "submitter_token",
]

SUBMITTER_KEY = "swarm-submitter"  # the gRPC metadata key of a submitter's (or admin's) token
# Names are shown by `swarm status` and stored with each job: a plain alphabet, as job names.
SUBMITTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADMIN = "admin"  # the admin's own name: jobs it submits are recorded under it; none is issued it
_CONTEXT = b"swarm-submitter/"  # a submitter token is never another use's digest of the secret


def check_submitter_name(name: str) -> str:
    """`name`, or ConfigError when it is not one a submitter token may name."""
    if not SUBMITTER_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"submitter name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit"
        )
    if name == ADMIN:
        raise ConfigError(f"submitter name {ADMIN!r} is the admin's own: choose another")
    return name


def _digest(admin_token: str, name: str) -> str:
    return hmac.new(admin_token.encode(), _CONTEXT + name.encode(), hashlib.sha256).hexdigest()


def submitter_token(admin_token: str, name: str) -> str:
    """The token that names `name` to a scheduler holding `admin_token`."""
    if not admin_token:
        raise ConfigError("an empty admin token would let anyone make submitter tokens")
    return f"{check_submitter_name(name)}:{_digest(admin_token, name)}"


def admin_credential(admin_token: str) -> str:
    """The admin's credential to a scheduler holding `admin_token`: made from it as a
    submitter's token is, never the admin token itself."""
    if not admin_token:
        raise ConfigError("an empty admin token would let anyone make submitter tokens")
    return f"{ADMIN}:{_digest(admin_token, ADMIN)}"


def is_admin_token(admin_token: str, given: str) -> bool:
    """Whether `given` is the admin token itself (compared as digests, in constant time)."""
    expected = hashlib.sha256(admin_token.encode()).digest()
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), expected)


def submitter_of(admin_token: str, given: str) -> str | None:
    """Who `given` names: `ADMIN` for `admin_credential`, a submitter's name for a token
    `submitter_token` made with `admin_token`, None for anything else (the admin token itself
    included: it is no credential)."""
    name, _, digest = given.partition(":")
    if not SUBMITTER_NAME_RE.fullmatch(name):
        return None
    if not hmac.compare_digest(digest.encode(), _digest(admin_token, name).encode()):
        return None
    return name
