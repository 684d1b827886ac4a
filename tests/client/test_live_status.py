"""`swarm status JOB --watch`: the live view redraws in place and tells what changed between two
looks (replicas that joined, left or moved, rollbacks, state changes), until the job ends."""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Callable

from client.live import (
    CLEAR_BELOW,
    CLEAR_LINE,
    HIDE_CURSOR,
    HOME,
    SHOW_CURSOR,
    LiveView,
    events,
    status_lines,
    trust_lines,
    watch_status,
)
from client.outage import Outage
from swarm.ops.progress import duration_text
from swarm.proto import control_pb2 as cpb
from swarm.proto import scheduler_pb2 as spb
from tests.support.jobs import BASE, render


def _status(step: int, where: dict[str, int], state: int = cpb.JOB_STATE_RUNNING) -> spb.JobStatus:
    stages = [spb.StageStatus(stage=k, layers=[k]) for k in range(3)]
    for peer, stage in where.items():
        stages[stage].replicas.append(
            spb.Replica(peer=peer, device="cpu", state=cpb.PEER_STATE_SERVING)
        )
    return spb.JobStatus(job="j-1", name="j", state=state, step=step, steps=50, stages=stages)


def test_events_name_joins_leaves_moves_rollbacks_and_state_changes() -> None:
    before = _status(12, {"p0": 0, "p1": 1, "p2": 2, "p3": 2})
    after = _status(10, {"p0": 0, "p1": 1, "p3": 1, "p4": 2})
    after.message = "stage 2: rolled back to the checkpoint of step 10"
    assert events(before, after) == [
        "rolled back from step 12 to step 10",
        "p2 left stage 2 (killed, stopped or moving)",
        "p3 moved from stage 2 to stage 1",
        "p4 joined stage 2",
        "stage 2: rolled back to the checkpoint of step 10",
    ]
    done = _status(50, {}, cpb.JOB_STATE_SUCCEEDED)
    assert events(after, done)[0] == "job running -> succeeded"
    assert events(done, done) == []


def test_a_frame_keeps_the_recent_events_and_redraws_in_place() -> None:
    view = LiveView(keep=2, clock=lambda: 0.0)
    view.frame(_status(1, {"p0": 0}))
    view.frame(_status(2, {"p0": 1}))
    view.frame(_status(3, {"p0": 1, "p1": 0}))
    text = view.frame(_status(4, {"p1": 0}))
    assert "step     4/50" in text and "stage 0 (layer 0): 1 replica(s)" in text
    tail = text.split("recent events:\n")[1].splitlines()  # the two newest, oldest first
    assert [line.split(" ", 3)[-1] for line in tail] == [
        "p1 joined stage 0",
        "p0 left stage 1 (killed, stopped or moving)",
    ]
    out = io.StringIO()
    looks = iter([_status(1, {"p0": 0}), _status(2, {"p0": 0}), _status(50, {}, 4)])

    outage = Outage(math.inf, clock=lambda: 0.0)

    async def get(unreachable: Callable[[Outage], None]) -> spb.JobStatus:
        status = next(looks)
        if status.step == 2:  # the scheduler did not answer once before this look
            outage.failed()
            unreachable(outage)
        return status

    final = asyncio.run(watch_status(get, out, interval_s=0, tty=True, done=lambda s: s.state == 4))
    assert final.step == 50
    written = out.getvalue()
    assert written.startswith(HIDE_CURSOR) and written.endswith(SHOW_CURSOR)
    frames = written.removesuffix(SHOW_CURSOR).split(HOME)[2:]  # one frame per look
    assert len(frames) == 4
    # The outage is drawn in place, above the last frame the scheduler gave.
    assert frames[1].startswith("scheduler unreachable since ") and "step     1/50" in frames[1]
    for frame in frames:  # every line cleared to its end, the rest cleared below: no flicker
        assert frame.endswith(CLEAR_BELOW)
        assert all(line.endswith(CLEAR_LINE) for line in frame[: -len(CLEAR_BELOW)].splitlines())


def test_what_peers_and_the_scheduler_say_reaches_the_terminal_escaped() -> None:
    # A peer names itself and its device; a message or error may quote what a peer sent. Raw,
    # an escape sequence clears the operator's screen or retitles the terminal, and a newline
    # draws a line of its own (a fake "state succeeded").
    hostile = "p\x1b[2J\x1b]0;owned\x07"
    before = _status(3, {"p0": 0})
    after = _status(4, {"p0": 0, hostile: 1})
    after.stages[1].replicas[0].device = "cpu\rstate    succeeded"
    after.message = "stage 1: peer said \x1b[31mhi\nstate    succeeded"
    after.error = "x\x00y"
    view = LiveView(clock=lambda: 0.0)
    view.frame(before)
    text = view.frame(after)
    assert not any(c in text for c in "\x1b\x07\x00\r"), repr(text)
    assert "state    succeeded" not in text.splitlines()
    assert text.count("\nstate    ") == 1 and text.startswith("job ")  # the real one only
    assert "p\\x1b[2J\\x1b]0;owned\\x07" in text and "\\nstate    succeeded" in text


def test_status_says_what_the_job_waits_for_how_long_its_warnings_and_its_history() -> None:
    s = _status(89, {"p0": 0, "p2": 2})
    s.message = "stalled at step 89: stage 1 has no replica since 12:00:00; start a stage server"
    s.waiting_since = 1000.0
    s.warnings.append("stage 0 has a single replica (p0): if it is lost, ...")
    s.events.extend(spb.JobEvent(time=990.0 + i, kind="join", text=f"event {i}") for i in range(12))
    lines = status_lines(s, now=1078.0, events=10)
    assert any(
        line.startswith("message  stalled at step 89")
        and line.endswith(
            "(for 1m18s, since " + time.strftime("%H:%M:%S", time.localtime(1000.0)) + ")"
        )
        for line in lines
    ), lines
    assert "warning  stage 0 has a single replica (p0): if it is lost, ..." in lines
    history = lines[lines.index("events:") + 1 :]
    assert [line.split(" ", 3)[-1] for line in history] == [f"event {i}" for i in range(2, 12)]
    # Watching shows the job's own history from the start, not what changed between looks.
    text = LiveView(keep=3, clock=lambda: 1078.0).frame(s)
    assert text.split("recent events:\n")[1].count("\n") == 2 and "event 11" in text
    assert "1m18s" in text


def test_an_ended_job_shows_how_long_it_took_and_its_mean_speed() -> None:
    s = _status(50, {}, cpb.JOB_STATE_SUCCEEDED)
    s.created, s.updated, s.samples_per_second = 1000.0, 1000.0 + 3723.0, 241.5
    lines = status_lines(s, now=9999.0)
    assert "state    succeeded after 1h02m03s" in lines
    assert "speed    241.5 samples/s (mean over its steps)" in lines
    assert duration_text(59.6) == "1m00s" and duration_text(3.0) == "3s"


def test_a_replica_still_joining_is_shown_with_what_it_waits_for_and_not_counted() -> None:
    s = _status(7, {"p0": 0, "p1": 1})
    s.stages[0].replicas.append(
        spb.Replica(
            peer="far",
            device="cpu",
            state=cpb.PEER_STATE_JOINING,
            joining="not answering at 10.0.0.9:50051 (UNAVAILABLE); trying again in 4 s",
        )
    )
    lines = status_lines(s, now=0.0)
    assert "stage 0 (layer 0): 1 replica(s), 1 joining" in lines
    row = next(line for line in lines if line.startswith("  far"))
    assert row.endswith(
        "joining: not answering at 10.0.0.9:50051 (UNAVAILABLE); trying again in 4 s"
    )
    # Watching, it joins when it counts, not when it is first listed.
    before, after = _status(7, {"p0": 0}), _status(8, {"p0": 0})
    after.stages[0].replicas.append(
        spb.Replica(peer="p5", state=cpb.PEER_STATE_JOINING, joining="downloading state from p0")
    )
    assert events(before, after) == []
    admitted = _status(9, {"p0": 0, "p5": 0})
    assert events(after, admitted) == ["p5 joined stage 0"]


def test_a_standby_is_shown_as_standby_with_its_lag_and_neither_counted_nor_joining() -> None:
    # Issue 67: a standby follows its stage's updates and serves nothing; status names it so,
    # with its lag in steps, and watching, it does not "join" until it is promoted.
    s = _status(7, {"p0": 0, "p1": 1})
    words = "standby for stage 0, 1 step behind (following p0)"
    s.stages[0].replicas.append(
        spb.Replica(peer="sb", device="cpu", state=cpb.PEER_STATE_STANDBY, joining=words)
    )
    lines = status_lines(s, now=0.0)
    assert "stage 0 (layer 0): 1 replica(s), 1 standby" in lines
    row = next(line for line in lines if line.startswith("  sb"))
    assert row.endswith(words)
    assert events(_status(7, {"p0": 0}), s) == ["p1 joined stage 1"]


def test_each_replica_shows_its_path_and_link_rates_and_an_unreachable_one_its_remedy() -> None:
    s = _status(7, {})
    s.stages[0].replicas.extend(
        [
            spb.Replica(
                peer="home",
                device="cuda:0",
                state=cpb.PEER_STATE_SERVING,
                reachability=cpb.REACHABILITY_RELAYED,
                relay="relay.example:7000",
                upload_bytes_per_second=12.5e6,  # 100 Mbit/s
                download_bytes_per_second=2.5e6,  # 20 Mbit/s
            ),
            spb.Replica(
                peer="lab",
                device="cpu",
                state=cpb.PEER_STATE_SERVING,
                reachability=cpb.REACHABILITY_DIRECT,
                upload_bytes_per_second=1e5,
            ),
            spb.Replica(
                peer="far",
                device="cpu",
                state=cpb.PEER_STATE_SERVING,
                reachability=cpb.REACHABILITY_UNREACHABLE,
                reachability_detail="UNAVAILABLE: Connection refused: give the stage server "
                "--announce-host, forward port 5000, or start a relay",
            ),
            spb.Replica(peer="new", device="cpu", state=cpb.PEER_STATE_SERVING),
        ]
    )
    lines = status_lines(s, now=0.0)
    assert "PATH" in lines[lines.index("stage 0 (layer 0): 4 replica(s)") + 1]
    rows = [line for line in lines if line.startswith("  ") and not line.startswith("    ")]
    row = {line.split()[0]: line.split() for line in rows}
    assert row["home"][3:7] == ["via", "relay.example:7000", "100/20", "Mbit/s"]
    assert row["lab"][3:6] == ["direct", "0.8/?", "Mbit/s"]
    assert row["far"][3:5] == ["UNREACHABLE", "-"]
    assert row["new"][3:5] == ["-", "-"]  # not dialled back yet, rates not known
    assert (
        "    far is UNREACHABLE: UNAVAILABLE: Connection refused: give the stage server "
        "--announce-host, forward port 5000, or start a relay"
    ) in lines


def test_status_shows_bytes_per_token_per_boundary_and_direction() -> None:
    """Issue 52: forward at boundary k|k+1 is what stage k's replicas sent on, backward what
    stage k+1's sent back, summed over replicas; "-" before a token crossed."""
    s = _status(3, {"p0": 0, "p1": 1, "p2": 1, "p3": 2})
    assert not any(line.startswith("boundaries") for line in status_lines(s, now=0.0))

    def sent(stage: int, replica: int, forward: tuple[int, int], backward: tuple[int, int]) -> None:
        s.stages[stage].replicas[replica].boundary.CopyFrom(
            cpb.BoundaryTraffic(
                forward_bytes=forward[0],
                forward_tokens=forward[1],
                backward_bytes=backward[0],
                backward_tokens=backward[1],
            )
        )

    sent(0, 0, (1024, 8), (0, 0))  # 128 B/token on
    sent(1, 0, (300, 10), (1000, 4))  # two replicas of stage 1: 400 B over 10 tokens on,
    sent(1, 1, (100, 0), (0, 4))  # 1000 B over 8 tokens back
    lines = status_lines(s, now=0.0)
    at = lines.index("boundaries (bytes per token sent, as encoded):")
    assert [line.split() for line in lines[at + 1 : at + 4]] == [
        ["BOUNDARY", "FORWARD", "B/TOKEN", "BACKWARD", "B/TOKEN"],
        ["0|1", "128.0", "125.0"],
        ["1|2", "40.0", "-"],
    ]


def test_status_says_what_audits_cost_and_whom_they_banned() -> None:
    carry = '[runtime]\ndata_plane = "relay"\n[trust]\naudit_fraction = 0.25\n'
    s = spb.JobStatus(job="j", spec=carry)
    assert trust_lines(s) == [
        "audits   25% of each stage's microbatches re-executed and contributions: about +50% "
        "stage compute"
    ]
    s.events.append(spb.JobEvent(kind="ban", text="banned s1r0 (stage 1): an audit caught it"))
    assert trust_lines(s)[0].endswith("; banned for lying: s1r0")
    # the push plane (the default) audits contributions too
    assert trust_lines(spb.JobStatus(job="j", spec="")) == [
        "audits   4.5% of each stage's microbatches re-executed and contributions: about +9% "
        "stage compute"
    ]
    off = spb.JobStatus(job="j", spec="[trust]\naudit_fraction = 0\n")
    assert trust_lines(off) == []


def test_status_shows_what_each_replica_holds_and_the_window_trainers_take_from_it() -> None:
    s = _status(7, {"p0": 0, "p1": 0, "p2": 1, "p3": 2})
    training = {**BASE["training"], "stages": 3, "target_batch_size": 256}  # 64 a step
    s.spec = render({**BASE, "training": training})
    held = {"p0": 12, "p1": 9, "p2": 15}  # the last stage's p3 says nothing: it keeps none
    for st in s.stages:
        for r in st.replicas:
            r.activation_capacity = held.get(r.peer, 0)
    st = s.stages[1]
    st.replicas.append(spb.Replica(peer="new", state=cpb.PEER_STATE_JOINING))
    st.replicas[-1].activation_capacity = 40  # not a member yet: no trainer counts it
    lines = status_lines(s, now=0.0)
    assert "window   15 microbatches in flight a trainer (auto: by what the stages hold)" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  p")}
    assert rows["p0"][-2:] == ["12", "serving"] and rows["p3"][-2:] == ["-", "serving"]
    s.spec = render({**BASE, "training": training, "runtime": {"max_in_flight": 3}})
    assert "window   3 microbatches in flight a trainer (fixed)" in status_lines(s, now=0.0)
