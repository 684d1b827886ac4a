"""Why a hop failed (`swarm.rpc.causes`): a failure is its gRPC code and text; the first failure
behind each backoff is a WARNING at most once per rate window for each peer and cause (a cause's
numbers do not make it another), the rest are INFO; each stage's last failure is kept."""

from __future__ import annotations

import logging

import pytest

from swarm.errors import Busy, FailedPrecondition, PeerUnavailable, RemoteError
from swarm.rpc.causes import CAUSE_CHARS, FAILURE_LOG_S, Causes, described


def test_a_failure_is_its_code_and_text() -> None:
    assert described(FailedPrecondition("handover refused")) == (
        "FAILED_PRECONDITION: handover refused"
    )
    assert described(Busy("queue full")) == "RESOURCE_EXHAUSTED: queue full"
    # the client's errors name their code already: not twice
    assert described(PeerUnavailable("UNAVAILABLE: connection refused")) == (
        "UNAVAILABLE: connection refused"
    )
    assert described(RemoteError("boom", "INTERNAL")) == "INTERNAL: boom"
    assert described(ValueError("a bug")) == "ValueError: a bug"
    assert len(described(FailedPrecondition("x" * 10 * CAUSE_CHARS))) == CAUSE_CHARS


def test_the_first_failure_behind_each_backoff_is_one_warning_per_peer_and_cause_a_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "swarm.rpc.causes")
    now = [0.0]
    causes = Causes(clock=lambda: now[0])

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    refused = "handover refused at step %d"
    causes.failed(1, "b", FailedPrecondition(refused % 1), backoff_s=1.0)
    assert warnings() == [
        "stage 1: b failed: FAILED_PRECONDITION: handover refused at step 1; backoff 1.0 s, "
        "trying another replica"
    ]
    causes.failed(1, "b", FailedPrecondition(refused % 1), backoff_s=0.0)  # in backoff already
    now[0] += 2.0
    causes.failed(1, "b", FailedPrecondition(refused % 2), backoff_s=2.0)  # the same cause
    assert len(warnings()) == 1
    causes.failed(1, "c", FailedPrecondition(refused % 2), backoff_s=1.0)  # another peer
    causes.failed(1, "b", PeerUnavailable("UNAVAILABLE: gone"), backoff_s=4.0)  # another cause
    assert len(warnings()) == 3 and "c failed" in warnings()[1] and "gone" in warnings()[2]
    now[0] += FAILURE_LOG_S
    causes.failed(1, "b", FailedPrecondition(refused % 9), backoff_s=8.0)
    assert "(and 1 more like it in the last 60 s)" in warnings()[3]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "in backoff already" in infos[0].getMessage()

    last = causes.last(1)
    assert last is not None and str(last) == (
        "peer b: FAILED_PRECONDITION: handover refused at step 9"
    )
    assert causes.last(0) is None and causes.latest() == last
    assert not any("banned" in r.getMessage() for r in caplog.records)
