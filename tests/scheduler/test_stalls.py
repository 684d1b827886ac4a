"""What a running job waits for: a stage without a replica stalls it; its message says which
stage, since when, what to do and what will happen then; a single replica is a warning."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.history import History
from scheduler.speed import RecentSpeed
from scheduler.stalls import CHECKPOINT_LOOK_S, Health, StallWatch
from scheduler.store import JobStore
from swarm.rpc.lease import Replica


def _watch(
    store: JobStore,
    members: list[list[Replica]],
    step: Callable[[], int],
    checkpoint: Callable[[], int],
    message: list[str],
    now: list[float],
    **kwargs: Any,
) -> tuple[str, Health, StallWatch]:
    """A job in `store` and its watch: `message[0]` is what the job says, `now[0]` the time."""

    async def say(text: str) -> None:
        message[0] = text

    job = store.create("tiny", "spec", "/data", steps=800).id
    health = Health()
    watch = StallWatch(
        job,
        lambda: members,
        step,
        checkpoint,
        say,
        lambda: message[0],
        History(store),
        health,
        clock=lambda: now[0],
        **kwargs,
    )
    return job, health, watch


def test_a_lost_stage_is_named_with_its_remedy_and_what_follows(tmp_path: Path) -> None:
    now = [1000.0]
    members = [[Replica("a", "h:1")], [Replica("b", "h:2"), Replica("c", "h:3")]]
    checkpoint, step, message = [0], [89], ["training"]

    with JobStore(tmp_path / "jobs.db") as store:
        job, health, watch = _watch(
            store, members, lambda: step[0], lambda: checkpoint[0], message, now
        )

        async def look() -> None:
            await watch.look()

        asyncio.run(look())
        assert health.waiting_since == 0.0 and message == ["training"]
        assert [w.split(":")[0] for w in health.warnings] == ["stage 0 has a single replica (a)"]
        assert "rolls back to step 0 (no checkpoint)" in health.warnings[0]
        members[1].pop()  # two stages without a spare: one warning naming both
        asyncio.run(look())
        assert [w.split(":")[0] for w in health.warnings] == [
            "stages 0, 1 have a single replica each (a, b)"
        ]
        members[1].append(Replica("c", "h:3"))

        members[0] = []  # stage 0's only replica dies at step 89, no checkpoint yet
        now[0] += 1.0
        asyncio.run(look())
        assert health.waiting_since == 1001.0
        said = message[0]
        assert said.startswith("stalled at step 89: stage 0 has no replica since ")
        assert "start a stage server for this job" in said
        assert "training starts again from step 0 (no checkpoint yet: 89 step(s) lost)" in said
        checkpoint[0] = 80  # with one: what a rollback costs (read again within 10 s)
        now[0] += CHECKPOINT_LOOK_S
        asyncio.run(look())
        assert "every stage rolls back to step 80, the last checkpoint (9 step(s)" in message[0]
        assert health.waiting_since == 1001.0  # since the stage emptied, not since the look

        members[0] = [Replica("d", "h:4")]  # a fresh server takes the stage
        now[0] += 77.0 - CHECKPOINT_LOOK_S
        asyncio.run(look())
        assert health.waiting_since == 0.0
        assert message[0] == "training: stage 0 is served again (d) after 77 s without a replica"
        kinds = [(e.kind, e.text.split(":")[0]) for e in store.events(job)]
        assert kinds == [
            ("warning", "stage 0 has a single replica (a)"),
            ("warning", "stage 1 has a single replica (b)"),  # only what is new to it
            ("stall", "stage 0 lost its last replica at step 89"),
            ("resume", "stage 0 is served again (d) after 77 s without a replica"),
            ("warning", "stage 0 has a single replica (d)"),
        ]

        members[0] = []  # lost again; then a rollback says more before the stage is back
        asyncio.run(look())
        message[0] = "rolled back to step 80: a stage lost every replica; ..."
        members[0] = [Replica("e", "h:5"), Replica("f", "h:6")]
        asyncio.run(look())
        assert message[0].startswith("rolled back to step 80")  # not overwritten
        assert health.warnings == []


def test_steps_that_stop_while_every_stage_is_served_are_a_stall_too(tmp_path: Path) -> None:
    now = [0.0]
    members = [[Replica("a", "h:1"), Replica("b", "h:2")]]
    message = ["training"]
    speed = RecentSpeed(lambda: now[0])

    with JobStore(tmp_path / "jobs.db") as store:
        job, health, watch = _watch(
            store,
            members,
            lambda: 40,
            lambda: 0,
            message,
            now,
            speed=speed,
            progress=lambda: "step 40 waits for 2 of its 4 microbatches",
        )
        speed.start()
        for _ in range(40):  # a step every 2 s
            now[0] += 2.0
            speed.committed(8)
        asyncio.run(watch.look())
        assert message == ["training"] and health.waiting_since == 0.0
        now[0] += 59.0  # under a minute (and 20 steps): not yet
        asyncio.run(watch.look())
        assert message == ["training"]
        now[0] += 2.0
        asyncio.run(watch.look())
        assert message[0].startswith("stalled at step 40: no step committed since ")
        assert "(a step took about 2.0 s); step 40 waits for 2 of its 4 microbatches." in message[0]
        assert health.waiting_since == 80.0  # since the last commit
        now[0] += 5.0
        speed.committed(8)  # it moves again
        asyncio.run(watch.look())
        assert message == ["training"] and health.waiting_since == 0.0
        kinds = [(e.kind, e.text.split(":")[0]) for e in store.events(job)]
        assert kinds == [
            ("stall", "no step committed for 61 s at step 40"),
            ("resume", "steps commit again (step 40) after 66 s"),
        ]
