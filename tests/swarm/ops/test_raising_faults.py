"""`SWARM_FAULTS`' raising points (`forward-oom`, `backward-oom`, `averaging-oom`): parsed with
the rest, each fires once where it is due (and, naming a target, only there); a malformed spec
stops a stage server at its start, naming the variable, before it serves anything."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from swarm.errors import ConfigError
from swarm.ops import faults
from swarm.ops.faults import Fault, FaultPlan, Point, parse_faults
from tests.support.cli import swarm


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    faults.arm("")


def test_raising_points_parse_and_fire_once_each() -> None:
    armed = faults.arm("forward-oom@2,backward-oom@2,averaging-oom@3,p1:averaging-oom@3")
    assert [f.point for f in armed] == [
        Point.FORWARD_OOM,
        Point.BACKWARD_OOM,
        Point.AVERAGING_OOM,
        Point.AVERAGING_OOM,
    ]
    assert not faults.due(Point.FORWARD_OOM, 1)
    assert faults.due(Point.FORWARD_OOM, 2)
    assert not faults.due(Point.FORWARD_OOM, 2)  # spent: the retry goes through
    assert faults.due(Point.AVERAGING_OOM, 3, "p2")  # the untargeted one, anywhere
    assert not faults.due(Point.AVERAGING_OOM, 3, "p2")  # p1's is p1's alone
    assert faults.due(Point.AVERAGING_OOM, 3, "p1")
    assert faults.armed() == [Fault("", Point.BACKWARD_OOM, 2)]


def test_a_raising_fault_travels_to_its_process() -> None:
    planned = parse_faults("s1r0:averaging-oom@4,s1r1:backward@2")
    assert FaultPlan.for_process(planned, "s1r0") == "averaging-oom@4"
    assert FaultPlan().pending == [] and FaultPlan(planned).pending == []  # in-process only


def test_a_malformed_spec_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"SWARM_FAULTS='averaging-om@1': fault 'averaging-om@1'"):
        faults.arm("averaging-om@1")


@pytest.mark.timeout(120)
def test_a_stage_server_with_a_malformed_spec_stops_at_its_start(tmp_path: object) -> None:
    # Before: it started and served; the spec was read at its first averaging round, which then
    # failed on every replica of the pool the same way, round after round.
    done = swarm(
        "stage-server",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--insecure-no-token",
        env={"SWARM_FAULTS": "averaging@one"},
        check=False,
        timeout=100,
    )
    assert done.returncode != 0
    assert "SWARM_FAULTS='averaging@one'" in done.stdout + done.stderr, done.stderr[-2000:]
    assert "ready" not in done.stdout
