"""The scheduler's follow tickets (issue 44, N7): what a ticket binds (the job, the stage, the
follower, the source and the key), and that a new registration takes a fresh one."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.errors import PermissionDenied
from swarm.net.commit_auth import SchedulerKey
from swarm.net.follow_tickets import MAX_AGE_S, FollowTickets, issue_ticket

pytestmark = pytest.mark.attack("N7")


def test_a_ticket_names_one_follower_of_one_source_in_one_stage_of_one_job() -> None:
    key = SchedulerKey.generate()
    tickets = FollowTickets(key.public, "source")
    ticket = key.ticket("job", 1, "joiner", "source")
    tickets.check("job", 1, "joiner", ticket, fresh=True)
    for job, stage, follower in (("other", 1, "joiner"), ("job", 2, "joiner"), ("job", 1, "x")):
        with pytest.raises(PermissionDenied, match="not the scheduler's"):
            tickets.check(job, stage, follower, ticket, fresh=False)
    with pytest.raises(PermissionDenied, match="not the scheduler's"):  # for another source
        FollowTickets(key.public, "elsewhere").check("job", 1, "joiner", ticket, fresh=False)
    with pytest.raises(PermissionDenied, match="not the scheduler's"):  # another key's
        tickets.check(
            "job",
            1,
            "joiner",
            SchedulerKey.generate().ticket("job", 1, "joiner", "source"),
            fresh=False,
        )
    with pytest.raises(PermissionDenied, match="without the scheduler's ticket"):
        tickets.check("job", 1, "joiner", b"", fresh=False)
    with pytest.raises(PermissionDenied, match="malformed"):
        tickets.check("job", 1, "joiner", ticket[:-1], fresh=False)


def test_a_new_registration_takes_a_fresh_ticket() -> None:
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes_raw()
    now = [1_000_000.0]
    tickets = FollowTickets(public, "source", clock=lambda: now[0])
    old = issue_ticket(private, "job", 0, "joiner", "source", now[0] - MAX_AGE_S - 1)
    with pytest.raises(PermissionDenied, match="issued 301 s from now"):
        tickets.check("job", 0, "joiner", old, fresh=True)
    # Asking for updates under a registration it made: its age does not matter (the update
    # log lets silent followers go).
    tickets.check("job", 0, "joiner", old, fresh=False)
    tickets.check(
        "job",
        0,
        "joiner",
        issue_ticket(private, "job", 0, "joiner", "source", now[0] - 5),
        fresh=True,
    )
