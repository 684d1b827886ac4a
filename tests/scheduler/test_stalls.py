"""What a running job waits for: a stage without a replica stalls it; its message says which
stage, since when, what to do and what will happen then; a single replica is a warning."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.history import History
from scheduler.speed import RecentSpeed
from scheduler.stall_words import REMEDY
from scheduler.stalls import CHECKPOINT_LOOK_S, Health, StallWatch
from scheduler.store import JobState, JobStore
from swarm.rpc.lease import Replica


def _watch(
    store: JobStore,
    members: list[list[Replica]],
    step: Callable[[], int],
    checkpoint: Callable[[], int],
    message: list[str],
    now: list[float],
    states: list[str] | None = None,
    **kwargs: Any,
) -> tuple[str, Health, StallWatch]:
    """A job in `store` and its watch: `message[0]` is what the job says, `now[0]` the time,
    `states` the states the watch set, in order."""

    async def say(text: str, state: JobState | None) -> None:
        message[0] = text
        if state is not None and states is not None:
            states.append(state)

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
    checkpoint, step, message, states = [0], [89], ["training"], []

    with JobStore(tmp_path / "jobs.db") as store:
        job, health, watch = _watch(
            store, members, lambda: step[0], lambda: checkpoint[0], message, now, states
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
        assert health.waiting_since == 1001.0 and states == ["stalled"]
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
        assert states == ["stalled", "running"]
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
        assert states == ["stalled", "running", "stalled", "running"]
        assert health.warnings == []


def test_a_stage_only_banned_servers_are_on_is_lost_naming_them(tmp_path: Path) -> None:
    """The watch reads the members less the peers banned from the job (the coordinator's view):
    a stage served by banned servers alone has no replica, and its message names them."""
    now = [1000.0]
    members = [[Replica("a", "h:1")], []]
    message: list[str] = ["training"]

    def barred(stages: list[int]) -> dict[int, list[str]]:
        return {k: ["x"] for k in stages if k == 1}

    with JobStore(tmp_path / "jobs.db") as store:
        job, _, watch = _watch(store, members, lambda: 89, lambda: 0, message, now, barred=barred)
        asyncio.run(watch.look())
        now[0] += 1.0
        asyncio.run(watch.look())  # a second look, the same: it ended in a KeyError (no relay)
        said = message[0]
        assert said.startswith("stalled at step 89: stage 1 has no replica since "), said
        assert " (banned from this job: stage 1's x); start a stage server for this job" in said
        stall = [e.text for e in store.events(job) if e.kind == "stall"]
        assert stall == [
            "stage 1 lost its last replica at step 89: training stalled; its server(s) x banned "
            "from this job; start a stage server for this job (`swarm stage-server --broker URL`"
            ", as for the others)"
        ], stall


def test_a_stage_whose_peer_sent_refused_it_says_the_refusal(tmp_path: Path) -> None:
    """The peer the scheduler sent to an empty stage refused the job (`Mover.refused`): the
    stall names it with its words, in the message and in the job's history, and stays said
    through the looks after (a stage lost a second look with no plan, its relay up, was read
    as a relay's loss: a KeyError ended the look)."""
    now = [1000.0]
    members = [[Replica("a", "h:1")], []]
    message: list[str] = ["training"]
    refused: dict[int, str] = {}

    with JobStore(tmp_path / "jobs.db") as store:
        job, _, watch = _watch(
            store, members, lambda: 89, lambda: 0, message, now, refused=lambda: refused
        )
        asyncio.run(watch.look())
        refused[1] = "idle, sent to it, refused the job: 'building stage 1 failed (OOM)'"
        for _ in range(2):
            now[0] += 1.0
            asyncio.run(watch.look())
            said = message[0]
            assert said.startswith("stalled at step 89: stage 1 has no replica since "), said
            assert f" (stage 1: {refused[1]}); start a stage server for this job" in said, said
        stall = [e.text for e in store.events(job) if e.kind == "stall"]
        assert stall[1:] == [f"stage 1 has no replica: {refused[1]}; {REMEDY}"], stall


def test_the_look_a_stage_is_served_again_asks_refill_so_it_lets_the_stage_go(
    tmp_path: Path,
) -> None:
    """`refill` keeps what it did for each stage nobody serves (a refusal, with its words) until
    a look tells it the stage is served: asked only while stages were missing, it kept an old
    refusal, named again when the stage was lost hours later (a review found it)."""
    members = [[Replica("a", "h:1")], []]
    asked: list[list[int]] = []

    async def refill(missing: list[int]) -> dict[int, str]:
        asked.append(list(missing))
        return {}

    with JobStore(tmp_path / "jobs.db") as store:
        _, _, watch = _watch(
            store, members, lambda: 9, lambda: 0, ["training"], [1.0], refill=refill
        )
        asyncio.run(watch.look())
        members[1].append(Replica("b", "h:2"))  # served again
        asyncio.run(watch.look())
        asyncio.run(watch.look())  # nothing lost since: not asked
    assert asked == [[1], []], asked


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


def test_a_stall_says_the_spare_the_scheduler_moves_not_start_a_server(tmp_path: Path) -> None:
    # Stage 0 loses its only replica; the scheduler's `refill` moves a spare of stage 1 at
    # once. The message and the stall's event say that, not "start a stage server".
    now = [1000.0]
    members = [[Replica("a", "h:1")], [Replica("b", "h:2"), Replica("c", "h:3")], []]
    message, states = ["training"], []
    plans: dict[int, str] = {0: "moving c from stage 1 (a spare replica)"}
    asked: list[list[int]] = []

    async def refill(missing: list[int]) -> dict[int, str]:
        asked.append(missing)
        return {k: plans[k] for k in missing if k in plans}

    with JobStore(tmp_path / "jobs.db") as store:
        job, health, watch = _watch(
            store, members, lambda: 89, lambda: 80, message, now, states, refill=refill
        )
        members[2] = [Replica("d", "h:4")]
        asyncio.run(watch.look())
        assert asked == [] and states == []  # nothing missing: refill is not asked
        members[0] = []
        asyncio.run(watch.look())
        assert asked == [[0]] and states == ["stalled"] and health.waiting_since == 1000.0
        assert message[0].startswith("stalled at step 89: stage 0 has no replica since ")
        assert message[0].endswith(
            "; the scheduler is moving c from stage 1 (a spare replica): once it serves, every "
            "stage rolls back to step 80, the last checkpoint (9 step(s) trained again)"
        )
        assert "start a stage server" not in message[0]
        # Stage 2 is lost too, with no spare for it: its remedy is a server, stage 0's the move.
        members[2] = []
        asyncio.run(watch.look())
        assert (
            "stage 0: the scheduler is moving c from stage 1 (a spare replica); stage 2: "
            + ("start a stage server")
            in message[0]
        )
        plans[2] = "giving it to idle peer e"  # a peer joins: the scheduler sends it there
        asyncio.run(watch.look())
        members[0], members[2] = [Replica("c", "h:3")], [Replica("e", "h:5")]
        members[1] = [Replica("b", "h:2")]
        asyncio.run(watch.look())
        assert states == ["stalled", "running"]
        events = [(e.kind, e.text) for e in store.events(job) if e.kind != "warning"]
        assert events[:3] == [
            (
                "stall",
                "stage 0 lost its last replica at step 89: training stalled; moving c from "
                "stage 1 (a spare replica)",
            ),
            (
                "stall",
                "stage 2 lost its last replica at step 89: training stalled; start a stage "
                "server for this job (`swarm stage-server --broker URL`, as for the others)",
            ),
            ("move", "stage 2 has no replica: giving it to idle peer e"),
        ]


def test_stages_short_of_min_replicas_are_a_warning_naming_the_servers_it_takes(
    tmp_path: Path,
) -> None:
    now, message = [0.0], ["training"]
    members = [
        [Replica("a", "h:1"), Replica("b", "h:2")],
        [Replica("c", "h:3")],
        [Replica("d", "h:4")],
        [Replica("e", "h:5"), Replica("f", "h:6")],
    ]
    with JobStore(tmp_path / "jobs.db") as store:

        def warnings(min_replicas: int) -> list[str]:
            _, health, watch = _watch(
                store, members, lambda: 5, lambda: 0, message, now, min_replicas=min_replicas
            )
            asyncio.run(watch.look())
            return health.warnings

        # min_replicas 1: the single replicas, and what a spare for each takes
        assert warnings(1) == [
            "stages 1, 2 have a single replica each (c, d): if one is lost, training rolls back "
            "to step 0 (no checkpoint); a spare stage server would take over without loss (2 "
            "more stage server(s) with runtime.min_replicas = 2, or the scheduler's "
            "--min-replicas 2, give each one)"
        ]
        assert warnings(2) == [
            "stages 1, 2 have fewer than min_replicas = 2 (1, 1): 2 more stage server(s) would "
            "fill every stage; stages 1, 2 have a single replica each (c, d): if one is lost, "
            "training rolls back to step 0 (no checkpoint)"
        ]
        members[1].append(Replica("g", "h:7"))
        assert warnings(3)[0].startswith(
            "stages 0, 1, 2, 3 have fewer than min_replicas = 3 (2, 2, 1, 2): 5 more stage "
            "server(s) would fill every stage; stage 2 has a single replica (d): if it is lost"
        )
        assert warnings(2) == [
            "stage 2 has 1 of min_replicas = 2 replicas: 1 more stage server(s) would fill every "
            "stage; stage 2 has a single replica (d): if it is lost, training rolls back to step "
            "0 (no checkpoint)"
        ]
        members[2].append(Replica("h", "h:8"))
        assert warnings(2) == []  # every stage has its two


def test_a_refill_that_fails_leaves_the_stall_said_and_the_watch_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Moving a spare publishes on the bus; a broker hiccup there must not end the watch (and
    # with it the job's training attempt): the stall is said with its remedy, tried again.
    now = [1000.0]
    members: list[list[Replica]] = [[Replica("a", "h:1")], []]
    message, states = ["training"], []
    tries: list[list[int]] = []

    async def refill(missing: list[int]) -> dict[int, str]:
        tries.append(missing)
        raise ConnectionError("the broker went away")

    with JobStore(tmp_path / "jobs.db") as store:
        _, _, watch = _watch(
            store, members, lambda: 9, lambda: 0, message, now, states, refill=refill
        )
        asyncio.run(watch.look())
        now[0] += 1
        asyncio.run(watch.look())
    assert tries == [[1], [1]] and states == ["stalled"]
    assert message[0].startswith("stalled at step 9: stage 1 has no replica since ")
    assert "start a stage server" in message[0]
    assert "refill failed" in caplog.text and "the broker went away" in caplog.text


def test_a_job_that_cannot_progress_is_stalled_naming_the_cause_after_its_patience(
    tmp_path: Path,
) -> None:
    # No step ever committed and its trainer's microbatches fail: after the job's patience
    # (here shorter than the minute of a slow step), `stalled`, naming the failure; running
    # once a step commits.
    now, message = [1000.0], ["training"]
    states: list[str] = []
    speed = RecentSpeed(lambda: now[0])
    cause: list[str | None] = [None]
    with JobStore(tmp_path / "jobs.db") as store:
        job, health, watch = _watch(
            store,
            [[Replica("a", "h:1")], [Replica("b", "h:2")]],
            lambda: 0,
            lambda: 0,
            message,
            now,
            states,
            speed=speed,
            progress=lambda: "step 0 waits for 4 of its 4 microbatches",
            cause=lambda: cause[0],
            patience_s=5.0,
        )
        speed.start()
        now[0] += 3.0  # within its patience
        asyncio.run(watch.look())
        assert message == ["training"] and states == []
        cause[0] = "stage 1: peer b: FAILED_PRECONDITION: handover refused"
        now[0] += 3.0
        asyncio.run(watch.look())
        assert states == ["stalled"] and health.waiting_since == 1000.0  # since training began
        assert message[0].startswith("stalled at step 0: cannot progress, no step committed")
        assert (
            "the last failure: stage 1: peer b: FAILED_PRECONDITION: handover refused; "
            in (message[0])
        )
        assert message[0].endswith("carries on by itself once the cause clears")
        asyncio.run(watch.look())
        assert states == ["stalled"]  # said once
        cause[0] = None  # the cause clears: a step commits
        now[0] += 1.0
        speed.committed(8)
        asyncio.run(watch.look())
        assert states == ["stalled", "running"] and message == ["training"]
        kinds = [(e.kind, e.text.split(":")[0]) for e in store.events(job)]
        assert ("stall", "no step committed for 6 s at step 0") in kinds
        assert kinds[-1] == ("resume", "steps commit again (step 0) after 7 s")
