"""The update log a replica keeps for the peers copying it: nothing kept without followers,
every update a follower lacks kept in order, bounded in bytes, forgotten once followers are done."""

from __future__ import annotations

import pytest
import torch

from stage_server.replica.update_log import UpdateLog
from swarm.errors import FailedPrecondition, ResourceExhausted
from swarm.rpc.state_streams import Update


def _sums(value: float, n: int = 4) -> list[torch.Tensor]:
    return [torch.full((n,), value, dtype=torch.float64)]  # 8 * n bytes


def test_nothing_is_kept_while_nobody_follows() -> None:
    log = UpdateLog(max_bytes=1 << 20)
    log.record(Update(0, _sums(1.0), 16))
    assert len(log) == 0 and log.nbytes == 0


def test_a_follower_gets_every_update_from_its_step_in_order() -> None:
    log = UpdateLog(max_bytes=1 << 20)
    log.follow("b", 3)
    sums = _sums(2.0)
    for step in (3, 4, 5):
        log.record(Update(step, sums, 16 + step))
    sums[0].fill_(-1.0)  # the log holds copies, not the replica's tensors
    got = log.since("b", 3)
    assert [(u.step, u.total_samples) for u in got] == [(3, 19), (4, 20), (5, 21)]
    assert all(torch.equal(u.grad_sums[0], _sums(2.0)[0]) for u in got)
    assert [u.step for u in log.since("b", 5)] == [5]  # it has 3 and 4: those go
    assert len(log) == 1
    assert log.since("b", -1) == [] and len(log) == 0  # done: nothing kept
    log.record(Update(6, _sums(1.0), 16))
    assert len(log) == 0


def test_the_log_is_bounded_and_a_follower_left_behind_must_copy_again() -> None:
    log = UpdateLog(max_bytes=3 * 32)  # three updates of 32 bytes
    log.follow("b", 0)
    for step in range(5):
        log.record(Update(step, _sums(float(step)), 16))
    assert len(log) == 3 and log.nbytes <= 3 * 32
    with pytest.raises(FailedPrecondition, match=r"no longer kept.*copy the state again"):
        log.since("b", 1)
    with pytest.raises(FailedPrecondition, match="does not follow"):
        log.since("b", 2)  # it was let go: it must start again
    assert len(log) == 0


def test_the_log_keeps_what_the_slowest_follower_needs() -> None:
    log = UpdateLog(max_bytes=1 << 20)
    log.follow("b", 0)
    log.record(Update(0, _sums(0.0), 16))
    log.follow("c", 1)
    log.record(Update(1, _sums(1.0), 16))
    assert [u.step for u in log.since("c", 2)] == []
    assert [u.step for u in log.since("b", 0)] == [0, 1]
    log.since("b", -1)
    assert len(log) == 0  # c has every update


def test_a_silent_follower_is_forgotten_and_a_cleared_log_lets_followers_go() -> None:
    now = [0.0]
    log = UpdateLog(max_bytes=1 << 20, clock=lambda: now[0])
    log.follow("b", 0)
    log.record(Update(0, _sums(0.0), 16))
    now[0] = UpdateLog.FOLLOWER_TTL_S + 1
    log.record(Update(1, _sums(1.0), 16))
    with pytest.raises(FailedPrecondition, match="does not follow"):
        log.since("b", 0)
    log.follow("c", 2)
    log.record(Update(2, _sums(2.0), 16))
    log.clear()  # the replica loaded another state
    with pytest.raises(FailedPrecondition, match="does not follow"):
        log.since("c", 2)


def test_followers_are_bounded_in_number_and_a_silent_one_is_let_go() -> None:
    now = [0.0]
    log = UpdateLog(max_bytes=1 << 20, clock=lambda: now[0], max_followers=2, ttl_s=60.0)
    log.follow("b", 0)
    log.follow("c", 0)
    with pytest.raises(ResourceExhausted, match=r"2 peers are copying .*--max-followers 2"):
        log.follow("d", 0)
    log.follow("b", 1)  # one already following takes its state again: no new place
    log.record(Update(0, _sums(0.0), 16))
    now[0] = 50.0
    log.touch("b")  # its download goes on: heard
    now[0] = 100.0  # c silent for 100 s, b for 50 s
    log.follow("d", 1)  # c's place, let go
    with pytest.raises(FailedPrecondition, match="does not follow"):
        log.since("c", 0)
    assert [u.step for u in log.since("b", 1)] == []
    # The peer's bounds, applied to a log that exists: fewer bytes, followers, seconds.
    log.record(Update(1, _sums(1.0), 16))
    log.record(Update(2, _sums(2.0), 16))
    log.bound(max_bytes=32, max_followers=1, ttl_s=10.0)
    assert len(log) == 1 and log.nbytes <= 32
    now[0] = 111.0  # both silent for more than 10 s: gone, and what they held with them
    log.record(Update(3, _sums(3.0), 16))
    assert len(log) == 0
    log.follow("e", 4)
    with pytest.raises(ResourceExhausted, match="--max-followers 1"):
        log.follow("f", 4)


@pytest.mark.attack("N7")
def test_a_place_is_held_only_by_a_copy_that_goes_on() -> None:
    # Issue 44, N7: a download that ended early lets its follower go at once; one that took the
    # state must ask for the updates after it within FIRST_ASK_S; a later download of the same
    # name is not let go by an earlier one's end.
    now = [0.0]
    log = UpdateLog(max_bytes=1 << 20, clock=lambda: now[0], max_followers=2, ttl_s=600.0)
    hung_up = log.follow("x", 0)
    log.unfollow("x", hung_up)
    took = log.follow("y", 0)
    log.sent("y", took)
    joiner = log.follow("z", 0)
    log.sent("z", joiner)
    with pytest.raises(ResourceExhausted, match="--max-followers 2"):
        log.follow("w", 0)
    now[0] = UpdateLog.FIRST_ASK_S / 2
    assert log.since("z", 0) == []  # z asks: it copies
    now[0] = UpdateLog.FIRST_ASK_S + 1  # y never asked: gone; z asked, kept till its ttl
    log.follow("w", 0)
    with pytest.raises(FailedPrecondition, match="does not follow"):
        log.since("y", 0)
    assert log.since("z", 0) == []
    again = log.follow("w", 1)  # w takes the state again: the first download's end is moot
    log.unfollow("w", again - 1)
    assert log.since("w", 1) == []


def test_an_ask_waiting_for_the_next_update_is_woken_as_it_is_kept() -> None:
    # The long poll of Updates (issue 67): a standby gets each step's update as its source
    # applies it, so it is not a step behind when the stage dies between its asks.
    log, woken = UpdateLog(max_bytes=1 << 20), []
    wake = lambda: woken.append(len(log))  # noqa: E731
    log.watch(wake)
    log.record(Update(0, _sums(1.0), 16))  # nobody follows: nothing kept, nobody woken
    assert woken == []
    log.follow("b", 1)
    log.record(Update(1, _sums(1.0), 16))
    assert woken == [1]  # woken once it is kept: the ask reads it
    log.unwatch(wake)
    log.record(Update(2, _sums(1.0), 16))
    assert woken == [1]
