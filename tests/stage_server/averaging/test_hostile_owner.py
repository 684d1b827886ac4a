"""Hostile replicas in a pool's averaging (issue 55). One owns a part and answers its part's
sums plus 1e4 (finite, the same to every member). Every replica takes the same wrong sum, so the
pool stays bitwise identical and no comparison among its members can see it; the job
"succeeded" 0.06 away from `swarm local`. Every part's sum is now checked (the linear checksum of
`scheduler.coordinator.trust.sum_checks`, a replica's part as an aggregator's): the round fails
naming the owner, which is banned (its sum's norm convicts it:
`scheduler.coordinator.trust.sum_liars`) and its work replayed away, so the job equals `swarm
local`. Another contributes its gradient times 1e4 (every sum checks out): the norm bound refuses
it (never banned: an honest gradient may pass the bound), its microbatches are replayed by the
others and it stays in its pool; refused again at the same step, it is left out. Real stage
servers on real ports, in this process (so one's averager or commit can lie)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.coordinator import LocalCoordinator, gather_state
from stage_server.averaging.summing import Reduced, Summer
from swarm.job.config import JobConfig
from swarm.job.fingerprint import fingerprint
from swarm.model.routes import Record
from tests.support.equality import assert_equal_to_reference
from tests.support.inprocess import Swarm
from tests.support.jobs import make_job

ERROR = 1e4  # what the hostile owner adds to every element of the sums it answers


def _lying(honest: Summer, forged: list[int]) -> Summer:
    """`honest`, with `ERROR` added to every sum (after the sum: every member gets the same)."""

    def wrong(
        values: list[torch.Tensor], owned: list[bool], codec: int, block_size: int
    ) -> Reduced:
        reduced = honest(values, owned, codec, block_size)
        forged.append(reduced.tensor.numel())
        wrong = reduced.tensor + ERROR
        return Reduced(wrong, None, wrong)

    return wrong


async def _pool(
    tmp_path: Path,
    make_swarm: list[Swarm],
    steps: int,
    pool: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
) -> tuple[JobConfig, Swarm]:
    """A float64 job of `steps` steps (`pool` its [pool], `runtime` its [runtime]), and three
    replicas of each stage."""
    training = {"steps": steps, "target_batch_size": 32, "checkpoint_every": 0}
    job = make_job(tmp_path, training=training, pool=pool or {}, runtime=runtime or {})
    swarm = Swarm(job)
    make_swarm.append(swarm)
    await swarm.add_replicas(3)
    return job, swarm


async def _trained(
    job: JobConfig, swarm: Swarm, caplog: pytest.LogCaptureFixture
) -> tuple[LocalCoordinator, list[Record]]:
    """`job` trained on `swarm` by two trainers, warnings captured: its coordinator (to close)
    and the routes its rounds took (for `swarm local` to replay)."""
    routes: list[Record] = []
    coordinator = LocalCoordinator(job, fingerprint(job), swarm.members, on_route=routes.append)
    with caplog.at_level(logging.WARNING):
        await swarm.train(coordinator, trainers=2)
    return coordinator, routes


@pytest.mark.attack("55-owner")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["step", "local"])
async def test_a_replica_owner_s_wrong_sum_fails_its_round_and_the_job_stays_exact(
    tmp_path: Path, make_swarm: list[Swarm], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """Three replicas a stage (float64); the last replica of stage 0 adds 1e4 to its part's
    sums. The round it owns a part of fails naming it; in a step's round its sum's norm, past
    what it says it summed, convicts it: banned, the job replayed without it (a local-steps
    round only goes on without it), and the job equals `swarm local` within 1e-9 (`--routes`
    for the rounds)."""
    pool = {} if mode == "step" else {"mode": "local", "sync_every": 2}
    job, swarm = await _pool(tmp_path, make_swarm, 4 if pool else 3, pool)
    liar = swarm.servers[0][2]
    forged: list[int] = []
    averager = liar.servicer.averager
    averager.summer = _lying(averager.summer, forged)
    coordinator, routes = await _trained(job, swarm, caplog)
    assert forged, "the liar owned a part of a round"
    assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
    assert coordinator.metrics.aborted_rounds._value.get() >= 1
    named = [r.getMessage() for r in caplog.records if "fails its checksum" in r.getMessage()]
    assert any(liar.address in m for m in named), named
    if mode == "step":  # its sum's norm convicts it: banned, replayed away, never back
        assert list(coordinator.bans.banned) == [liar.address]
        assert "by its own report" in coordinator.bans.banned[liar.address]
        assert len(named) == 1, named  # no later round had it to fail
    await coordinator.close()


@pytest.mark.attack("55-norm")
@pytest.mark.timeout(180)
async def test_a_replica_s_finite_wrong_gradient_is_refused_by_the_norm_bound(bent: Bent) -> None:
    """Issue 55, item 4: a replica of stage 1 multiplies the gradient sums it contributes by
    1e4 (finite; every part it sends, its own part's too, so every sum checks out). With the
    norm bound on (the default), its contribution is far past the others' per microbatch: the
    round fails, its microbatches are replayed by the others (the step's replays routed around
    it), and the job equals `swarm local` within 1e-9 (the bound refuses, it never scales).
    It stays in its pool, as an honest replica whose microbatches were the step's largest
    must (before: left out, it copied a member's state to come back, every such step): with
    none of the step's microbatches left, it sends zeros, which pass."""
    liar, poisoned, coordinator, said = await bent(lambda t: t.mul_(1e4))
    # named once, and said to be a yardstick an honest gradient spike can pass too
    named = [m for m in said if "named it" in m]
    assert any(liar.address in m and "stays in its pool" in m for m in named), named
    assert all(m.count("norm bound") == 1 for m in named), named
    assert all("honest gradient spike" in m for m in named), named
    assert not any(liar.address not in m for m in named), named  # no honest replica named
    assert not [m for m in said if "leaving" in m]  # nobody left out: no state copied
    assert coordinator.metrics.dropped._value.get() == 0
    # Once a step at most (a step whose routing gave it nothing has nothing to refuse), and at
    # step 0, whose routing tries every replica before any twice
    refused = coordinator.metrics.refused._value.get()
    assert 1 <= refused <= len(set(poisoned)), poisoned
    assert coordinator.job.trust.clip == "norm_bound"  # the default
    await coordinator.close()


@pytest.mark.attack("55-norm")
@pytest.mark.timeout(180)
async def test_a_replica_past_the_norm_bound_again_at_the_same_step_is_left_out(bent: Bent) -> None:
    """A replica of stage 1 adds 1e4 to every gradient sum it contributes, so that even with
    none of the step's microbatches (voided, the replays routed around it) it is past the bound
    again: refused twice at one step, it is left out (never banned), and the job equals `swarm
    local` within 1e-9."""
    liar, _, coordinator, said = await bent(lambda t: t.add_(1e4))
    stays = [m for m in said if "stays in its pool" in m and "named it" in m]
    left = [m for m in said if "leaving" in m and "named it" in m]
    assert any(liar.address in m for m in stays), stays  # refused once: voided
    assert any(liar.address in m and "norm bound" in m for m in left), left  # and again
    assert not any(liar.address not in m for m in stays + left), stays + left
    assert not coordinator.bans.banned
    await coordinator.close()


@pytest.mark.attack("55-norm")
@pytest.mark.timeout(180)
async def test_a_round_that_only_voided_replicas_past_the_bound_is_not_one_of_the_step_s_failures(
    bent: Bent,
) -> None:
    """`runtime.max_commit_rounds = 1`, and the x1e4 liar refused at every step: each round
    that only voided it (once a step) is not counted, so the job ends at `swarm local`'s
    parameters (before: the first refusal failed the job). One owner's word could otherwise
    spend two of a step's rounds on every honest sender it names past the bound (voided, then
    its zeros named again: left out)."""
    _, poisoned, coordinator, _ = await bent(
        lambda t: t.mul_(1e4), runtime={"max_commit_rounds": 1}
    )
    assert coordinator.error is None, coordinator.error
    assert coordinator.metrics.refused._value.get() >= 1, poisoned  # step 0's, at least
    await coordinator.close()


# (bend, [runtime]) -> the liar, the steps it bent at (a round each), the coordinator (to
# close), the log
Bent = Callable[..., Awaitable[tuple[Any, list[int], LocalCoordinator, list[str]]]]


@pytest.fixture
def bent(
    tmp_path: Path,
    make_swarm: list[Swarm],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> Bent:
    """A 3-step job on three replicas a stage, the last of stage 1 bending the gradient sums it
    contributes by `bend` before it averages them (every part it sends, its own part's too, so
    every sum checks out), trained to `swarm local`'s parameters within 1e-9 (`runtime`: the
    job's [runtime])."""

    async def run(
        bend: Callable[[torch.Tensor], object], runtime: dict[str, Any] | None = None
    ) -> Any:
        job, swarm = await _pool(tmp_path, make_swarm, 3, runtime=runtime)
        liar = swarm.servers[1][2]
        committer = liar.servicer._commits
        honest, poisoned = committer._average, []

        async def bent(c: Any, sums: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            for t in sums:
                bend(t)
            poisoned.append(c.step)
            return await honest(c, sums, *args, **kwargs)

        monkeypatch.setattr(committer, "_average", bent)
        coordinator, routes = await _trained(job, swarm, caplog)
        assert poisoned, "the liar contributed to a round"
        assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
        return liar, poisoned, coordinator, [r.getMessage() for r in caplog.records]

    return run


@pytest.mark.attack("55-report")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["step", "local"])
async def test_a_member_lying_about_what_it_sent_leaves_alone_and_the_job_stays_exact(
    tmp_path: Path,
    make_swarm: list[Swarm],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """A replica of stage 0 sends honest values but reports r·x of what it sent each other
    owner off by 1e-3 of its magnitude. Its words disagree with both owners' about what they
    received (`scheduler.coordinator.trust.sent_words`): in a step's round it is banned, in a
    local-steps round dropped, alone either way (before: every owner's r·S failed, and the
    honest owners were the ones left out), and the job equals `swarm local` within 1e-9."""
    pool = {} if mode == "step" else {"mode": "local", "sync_every": 2}
    job, swarm = await _pool(tmp_path, make_swarm, 4 if pool else 3, pool)
    liar = swarm.servers[0][2]
    committer = liar.servicer._commits
    honest, lied = committer.commit, []

    async def lying(c: Any) -> Any:
        done = await honest(c)
        for check in done.sum_checks:
            if check.part != c.group_index:
                check.dot += 1e-3 * (check.magnitude + 1.0)
                lied.append(c.step)
        return done

    monkeypatch.setattr(committer, "commit", lying)
    coordinator, routes = await _trained(job, swarm, caplog)
    assert lied, "the liar reported on a round"
    assert_equal_to_reference(job, await gather_state(coordinator), routes, tol=1e-9)
    said = [r.getMessage() for r in caplog.records]
    honest_ones = [r.address for r in swarm.servers[0][:2]]
    out = [m for m in said if "leaving" in m]  # left out of a step's rounds, or dropped
    out += [m.rsplit(": ", 1)[-1] for m in said if m.endswith("sit(s) out")]  # whom a round named
    assert not any(a in m for m in out for a in honest_ones), out
    if mode == "step":
        assert list(coordinator.bans.banned) == [liar.address]
        assert "what it sent" in coordinator.bans.banned[liar.address]
    else:
        assert f"['{liar.address}'] sit(s) out" in out, out
    await coordinator.close()
