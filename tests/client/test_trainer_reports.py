"""How a trainer reports: each finished microbatch is reported with a request for the slot's next
task in the same call, and one report call is in flight at a time, so what finishes while a slow
scheduler answers goes together in the next call. Behind the `LeaseSource` seam: a fake source,
and microbatches that compute nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from client.data_plane.hops import TrainerError
from client.trainer import PipelineTrainer
from swarm.job.config import load_job
from swarm.rpc.lease import Lease, MicrobatchResult, Replica, Task, Working
from tests.support.jobs import write_job

STEPS, MICROBATCHES = 3, 16


class _Source:
    """Gives each step's microbatches (one step at a time, as a coordinator does), answering
    every report call after `delay_s`; records the size of each call."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.step, self.given = delay_s, 0, 0
        self.reported: dict[int, list[int]] = {}
        self.batches: list[int] = []
        self.leases = 0

    def _take(self, count: int) -> Lease:
        if self.step >= STEPS:
            return Lease(self.step, [], [], done=True)
        n = min(count, MICROBATCHES - self.given)
        tasks = [Task(self.step, self.given + i, frozenset({0, 1})) for i in range(n)]
        self.given += n
        return Lease(self.step, tasks, [])

    async def lease(
        self, trainer: str, count: int, *, wait_s: float = 0.0, working: Sequence[Working] = ()
    ) -> Lease:
        self.leases += 1
        lease = self._take(count)
        if not lease.tasks and not lease.done:
            await asyncio.sleep(min(wait_s, 0.01))
        return lease

    async def report(self, trainer: str, result: MicrobatchResult) -> None:
        raise AssertionError("a trainer reports with report_and_lease")

    async def report_and_lease(
        self,
        trainer: str,
        results: Sequence[MicrobatchResult],
        count: int,
        *,
        working: Sequence[Working],
    ) -> Lease:
        await asyncio.sleep(self.delay_s)
        self.batches.append(len(results))
        for r in results:
            self.reported.setdefault(r.step, []).append(r.index)
        if len(self.reported.get(self.step, [])) == MICROBATCHES:  # the step commits
            self.step, self.given = self.step + 1, 0
        return self._take(count)

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        raise AssertionError("nothing fails here")


class _Instant(PipelineTrainer):
    async def _microbatch(self, task: Task) -> MicrobatchResult:
        await asyncio.sleep(0.001)
        return MicrobatchResult(task.step, task.index, {0: "a", 1: "b"}, 1.0, 4)


async def _to_the_end(trainer: PipelineTrainer, source: _Source) -> None:
    try:
        await asyncio.wait_for(trainer.run(), 30)
    finally:
        await trainer.close()
    assert {s: sorted(i) for s, i in source.reported.items()} == {
        s: list(range(MICROBATCHES)) for s in range(STEPS)
    }, "every microbatch is reported exactly once"


async def _train(tmp_path: Path, delay_s: float) -> _Source:
    job = load_job(write_job(tmp_path, training={"stages": 2}, runtime={"max_in_flight": 8}))
    source = _Source(delay_s)
    await _to_the_end(_Instant(job, source), source)
    return source


async def test_a_prompt_scheduler_gets_one_call_per_microbatch_that_also_leases(
    tmp_path: Path,
) -> None:
    source = await _train(tmp_path, 0.0)
    assert sum(source.batches) == STEPS * MICROBATCHES
    # Each call brought the next task: lease calls only at each step's start (and its end).
    assert source.leases <= 3 * STEPS, source.leases


async def test_a_slow_scheduler_gets_fewer_larger_calls(tmp_path: Path) -> None:
    source = await _train(tmp_path, 0.05)
    assert sum(source.batches) == STEPS * MICROBATCHES
    assert max(source.batches) > 1 and len(source.batches) < STEPS * MICROBATCHES / 2, (
        source.batches
    )


class _Releasing(_Source):
    """`_Source`, where a released microbatch is leased again at once (as the coordinator
    gives work back): counts the releases."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.released = 0
        self.back: list[int] = []  # released, given first

    def _take(self, count: int) -> Lease:
        again, self.back = self.back[:count], self.back[count:]
        lease = super()._take(count - len(again))
        if not again or lease.done:
            return lease
        tasks = [Task(self.step, i, frozenset({0, 1})) for i in again]
        return Lease(self.step, tasks + lease.tasks, [])

    async def release(
        self, trainer: str, indices: Sequence[int], failure: str | None = None
    ) -> None:
        self.released += len(indices)
        self.back += indices


class _FailingFor(_Instant):
    """Every microbatch fails at once for `fail_s` (a stage's every replica banned: no eligible
    replica), then they succeed."""

    def __init__(self, *args: object, fail_s: float) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.until = asyncio.get_running_loop().time() + fail_s

    async def _microbatch(self, task: Task) -> MicrobatchResult:
        if asyncio.get_running_loop().time() < self.until:
            raise TrainerError("stage 0: no eligible replica among 1: all banned")
        return await super()._microbatch(task)


async def test_microbatches_that_fail_at_once_are_retried_after_a_pause_not_in_a_spin(
    tmp_path: Path,
) -> None:
    """A microbatch that fails at once (every replica of a stage banned for a while) went back
    to the coordinator and came back within milliseconds: a trainer spun, logging a warning each
    time (hundreds a second, its CPU taken from the stage servers beside it on a small host).
    Each slot's retries back off (reset by a success), and the job still ends."""
    job = load_job(write_job(tmp_path, training={"stages": 2}, runtime={"max_in_flight": 2}))
    source = _Releasing()
    await _to_the_end(_FailingFor(job, source, fail_s=1.0), source)
    # Two slots, pauses doubling from 0.05 s: about 5 each in the failing second.
    assert 2 <= source.released <= 16, source.released


class _Holding(_Source):
    """`_Source` whose leases show two stages, stage 0's replicas holding `held` microbatches
    until step `until`, `after` from then on (what their load reports said, as the scheduler
    passes it on)."""

    def __init__(self, held: list[int], after: list[int], until: int) -> None:
        super().__init__(0.0)
        self.held, self.after, self.until = held, after, until

    def _take(self, count: int) -> Lease:
        lease = super()._take(count)
        held = self.held if self.step < self.until else self.after
        first = [Replica(f"r{i}", f"r{i}:7000", 0.0, c) for i, c in enumerate(held)]
        return Lease(lease.step, lease.tasks, [first, [Replica("z", "z:7000")]], lease.done)


class _Counting(_Instant):
    """Counts the most microbatches of each step in flight at once."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.now, self.most = 0, dict[int, int]()

    async def _microbatch(self, task: Task) -> MicrobatchResult:
        self.now += 1
        self.most[task.step] = max(self.most.get(task.step, 0), self.now)
        try:
            await asyncio.sleep(0.005)
            return await super()._microbatch(task)
        finally:
            self.now -= 1


async def test_an_auto_window_follows_what_the_stages_hold_as_it_changes(tmp_path: Path) -> None:
    """Stage 0 holds 2 + 3 microbatches in step 0's leases, then 1 (a floor of one a stage: 2
    in flight); the last stage keeps nothing and does not narrow it. What a step starts with
    was leased under the window before it; a window that shrank is kept as slots report: no
    slot asks for a next task past it, so the step after runs within it."""
    training = {"stages": 2, "target_batch_size": 4 * MICROBATCHES}
    job = load_job(write_job(tmp_path, training=training))
    assert job.runtime.max_in_flight == "auto"
    source = _Holding([2, 3], [1], until=1)
    trainer = _Counting(job, source)
    assert trainer.window == 8  # before any view of the stages: the window of old
    await _to_the_end(trainer, source)
    assert trainer.window == 2 and trainer.metrics.window._value.get() == 2
    assert trainer.most[1] <= 5 and trainer.most[2] <= 2, trainer.most
    grown = _Counting(job, _Holding([20, 20], [20, 20], until=0))
    grown.sync(_Holding([20, 20], [], until=9)._take(0).replicas)
    assert grown.window == MICROBATCHES  # all of a step, no more
    await grown.close()


class _Lavish(_Source):
    """`_Source`, whose first lease gives 10,000 microbatches whatever it was asked for (a
    scheduler impersonated on a swarm without TLS); counts the microbatches run at once."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.first, self.at_once, self.most = True, 0, 0

    def _take(self, count: int) -> Lease:
        if not self.first:
            return super()._take(count)
        self.first = False
        return Lease(0, [Task(0, i, frozenset({0, 1})) for i in range(10_000)], [])


async def test_a_lease_of_more_than_was_asked_for_runs_no_more_than_the_window(
    tmp_path: Path,
) -> None:
    # A review's repro: the trainer started a slot for every task a lease gave, whatever it
    # asked for: 10,000 tasks, 10,000 coroutines at once.
    job = load_job(write_job(tmp_path, training={"stages": 2}, runtime={"max_in_flight": 8}))
    source = _Lavish()

    class Counted(_Instant):
        async def _microbatch(self, task: Task) -> MicrobatchResult:
            source.at_once += 1
            source.most = max(source.most, source.at_once)
            try:
                return await super()._microbatch(task)
            finally:
                source.at_once -= 1

    trainer = Counted(job, source)
    try:
        await asyncio.wait_for(trainer.run(), 30)
    finally:
        await trainer.close()
    assert 0 < source.most <= trainer.window, (source.most, trainer.window)
