"""Who calls the job API, and what they may do to a job: its submitter, or an admin, may cancel,
delete or export it; everyone with the swarm token may read it (docs/deployment.md section 0).

A caller is named by, first, a submitter token (`swarm.net.submitters`) sent under
`SUBMITTER_KEY`: a submitter's name, or the admin for the admin's credential (the admin token
itself is refused: it is the root of every token and must not travel); else, under
`--tls-mutual`, its client certificate's name as `cert:NAME` (`CERT_PREFIX`: a name no token
can carry, so a host certificate named as a submitter is not that submitter, issue 54), the
certificate named `scheduler` (the scheduler's own, whose holder holds the job store anyway)
being an admin; else no one in particular: the swarm
token alone, one anonymous submitter shared by every holder of it (`ANONYMOUS`). A submitter
token that no admin token made is refused (UNAUTHENTICATED), never taken as anonymous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.store import JobRecord
from swarm.bus.topics import SCHEDULER_USER
from swarm.errors import PermissionDenied, Unauthenticated
from swarm.net import tls
from swarm.net.submitters import ADMIN, SUBMITTER_KEY, is_admin_token, submitter_of

__all__ = ["ANONYMOUS", "CERT_PREFIX", "Caller", "Callers", "shown"]

ANONYMOUS = ""  # the submitter of a job submitted with the swarm token alone
# A certificate's caller name begins so; a submitter name has no ':' (`SUBMITTER_NAME_RE`).
CERT_PREFIX = "cert:"


def shown(submitter: str) -> str:
    """A submitter for people."""
    return repr(submitter) if submitter else "the swarm token alone (no submitter named)"


@dataclass(frozen=True)
class Caller:
    name: str  # the submitter its jobs are recorded under; ANONYMOUS: the swarm token alone
    admin: bool = False  # may act on every job

    def manages(self, submitter: str) -> bool:
        """Whether this caller may manage a job of `submitter`'s: it is that submitter, or an
        admin. Such a caller's trainers are the job's own, and are told its step's contribution
        audits (`JobApiServicer.LeaseMicrobatches`)."""
        return self.admin or submitter == self.name

    def may_manage(self, record: JobRecord, action: str) -> None:
        """PermissionDenied unless this caller submitted `record` or is an admin."""
        if self.manages(record.submitter):
            return
        raise PermissionDenied(
            f"job {record.id!r} was submitted by {shown(record.submitter)}: only its submitter "
            f"or an admin may {action} it, and this call comes from {shown(self.name)} (send "
            "your submitter token: --submitter-token-file, SWARM_SUBMITTER_TOKEN)"
        )


class Callers:
    """Names the caller of each job API call. `admin_token`: the scheduler's
    (`--admin-token-file`; None: it issues no submitter tokens); `mutual`: client certificates
    are required and verified (None: as this process's TLS identity says)."""

    def __init__(self, admin_token: str | None = None, *, mutual: bool | None = None) -> None:
        self._admin_token = admin_token or None
        if mutual is None:
            identity = tls.current()
            mutual = identity is not None and identity.mutual
        self._mutual = mutual

    def identify(self, context: Any) -> Caller:
        """The caller of the call `context` serves (a grpc.aio ServicerContext)."""
        given = [v for k, v in context.invocation_metadata() or () if k == SUBMITTER_KEY]
        if len(given) > 1:
            raise Unauthenticated(f"more than one {SUBMITTER_KEY} value")
        if given:
            return self._by_token(given[0] if isinstance(given[0], str) else given[0].decode())
        if self._mutual:
            names = (context.auth_context() or {}).get("x509_common_name") or []
            if names:
                return self._by_certificate(names[0].decode(errors="replace"))
        return Caller(ANONYMOUS)

    def _by_token(self, token: str) -> Caller:
        if self._admin_token is None:
            raise Unauthenticated(
                "a submitter token was sent, but this scheduler issues none (it was started "
                "without --admin-token-file): leave out --submitter-token"
            )
        if is_admin_token(self._admin_token, token):
            raise Unauthenticated(
                "the admin token itself is no credential (it makes every submitter's): send "
                "the admin's, `swarm submitter-token admin` made from it"
            )
        name = submitter_of(self._admin_token, token)
        if name is None:
            raise Unauthenticated(
                "the submitter token is not one this scheduler's admin token made (`swarm "
                "submitter-token NAME` on the machine holding it)"
            )
        return Caller(name, admin=name == ADMIN)

    @staticmethod
    def _by_certificate(name: str) -> Caller:
        return Caller(CERT_PREFIX + name, admin=name == SCHEDULER_USER)
