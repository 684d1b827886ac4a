"""bench/audit_split.py's split of a run's CPU by what audits spend (issue 69, item 4), on canned
py-spy stacks and /proc readings, and bench/audit_cost.py's report of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import audit_cost

from bench import audit_split

LOOP = "_run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
WORKER = "Thread.run (threading.py:975);Worker._next (stage_server/replica/worker.py:186)"


def frames(*more: str, base: str = LOOP) -> list[str]:
    return [*base.split(";"), *more]


@pytest.mark.parametrize(
    ("stack", "part"),
    [
        # the worker re-executing, and the servicer's handler of a re-execution's call
        (frames("redoing (stage_server/replica/answering.py:95)", base=WORKER), "re-execution"),
        (
            frames(
                "StageServicer.Backward (stage_server/servicer.py:303)",
                "StageServicer._run_held (stage_server/servicer.py:270)",
                "StageServicer.Backward.<locals>.body (stage_server/servicer.py:310)",
            ),
            "re-execution",
        ),
        (frames("StageReexecutor.redo (client/audit/reexecute.py:40)"), "re-execution"),
        # a digest wherever it is taken: a record's digester, the trainer's check of a fetch
        (
            frames(
                "PushRecord.received.<locals>.<lambda> (stage_server/replica/push_records.py:190)",
                "digest (swarm/wire/digest.py:27)",
                base="Thread.run (threading.py:975)",
            ),
            "digests",
        ),
        (
            frames(
                "fetched_record (client/audit/push_fetch.py:63)", "digest (swarm/wire/digest.py:26)"
            ),
            "digests",
        ),
        # records fetched: the servicer's Record, the trainer's asks
        (frames("StageServicer.Record (stage_server/servicer.py:362)"), "records fetched"),
        (frames("PushAudits._commitment (client/audit/push_audit.py:250)"), "records fetched"),
        (frames("StageClient.record (swarm/rpc/stage_client.py:360)"), "records fetched"),
        # records kept: made, filled, the parameters kept for a late re-execution
        (frames("PushPlane._record (stage_server/replica/push.py:310)"), "records kept"),
        (frames("PushRecord.sent (stage_server/replica/push_records.py:200)"), "records kept"),
        (frames("PriorParams.keep (stage_server/replica/prior_params.py:80)"), "records kept"),
        # a lookup every step's work passes through, audits or none
        (frames("PriorParams.sums_of (stage_server/replica/prior_params.py:98)"), "rest"),
        (frames("PushAudits.audit (client/audit/push_audit.py:180)"), "trainer's audits"),
        # a push's own work, and the push's Forward of the worker (not the servicer's)
        (frames("StageServicer.Push (stage_server/servicer.py:352)"), "rest"),
        (frames("Compute.forward (stage_server/replica/runtime.py:200)", base=WORKER), "rest"),
    ],
)
def test_each_stack_counts_to_its_part(stack: list[str], part: str) -> None:
    assert audit_split.part_of(stack) == part


def test_py_spy_s_raw_stacks_are_counted_by_thread_and_part() -> None:
    raw = "\n".join(
        [
            f"thread (4242): MainThread;{LOOP};StageServicer.Record (stage_server/servicer.py:1) 3",
            f"thread (4242): MainThread;{LOOP};StageServicer.Push (stage_server/servicer.py:2) 5",
            "thread (4250): peer-digests_0;Thread.run (threading.py:975);"
            "digest (swarm/wire/digest.py:27) 7",
            "py-spy> a line of its own, not a stack",
        ]
    )
    got = audit_split.samples(raw)
    assert dict(got[4242]) == {"records fetched": 3, "rest": 5}
    assert dict(got[4250]) == {"digests": 7}


def test_a_thread_s_cpu_is_shared_out_as_its_samples_and_an_unseen_one_is_rest() -> None:
    sampled = audit_split.samples(
        "thread (1): MainThread;StageServicer.Record (stage_server/servicer.py:1) 1\n"
        "thread (1): MainThread;StageServicer.Push (stage_server/servicer.py:2) 3\n"
    )
    # thread 2 (gRPC's, in C) never sampled running
    split = audit_split.split_of({1: 2.0, 2: 0.5}, sampled)
    assert split["records fetched"] == pytest.approx(0.5)
    assert split["rest"] == pytest.approx(1.5 + 0.5)
    assert sum(split.values()) == pytest.approx(2.5)
    assert set(split) == set(audit_split.PARTS)


class Canned:
    """`audit_cost.Runner` with canned runs, audits on and off."""

    def __init__(self, on: audit_cost.Run, off: audit_cost.Run) -> None:
        self.runs = {0.045: on, 0.0: off}

    def __call__(self, steps: int, fraction: float, replicas: int) -> audit_cost.Run:
        return self.runs[fraction]


def test_fewer_pairs_give_figures_and_the_cpu_split_without_a_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parts_on = {p: (0.0, 0.0) for p in audit_split.PARTS} | {
        "re-execution": (0.4, 0.01),
        "digests": (0.05, 0.002),
        "rest": (4.0, 0.1),
    }
    parts_off = {p: (0.0, 0.0) for p in audit_split.PARTS} | {"rest": (4.0, 0.1)}
    on = audit_cost.Run(1.2, servers=4.45, trainer=0.112, parts=parts_on)
    off = audit_cost.Run(1.0, servers=4.0, trainer=0.1, parts=parts_off)
    assert audit_cost.main(["--pairs", "2", "--figures-only"], Canned(on, off)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "FIGURES ONLY (2 pairs, no verdict): audits on/off median 1.200"
    assert any(line.startswith("CPU s/step all") and "on/off median 1.113" in line for line in out)
    reexecution = next(line for line in out if line.startswith("re-execution"))
    assert reexecution.split()[1:] == ["0.4000", "0.0000", "0.0100", "0.0000", "0.4100"]
    with pytest.raises(SystemExit):  # a verdict still takes five pairs
        audit_cost.main(["--pairs", "2"], Canned(on, off))
