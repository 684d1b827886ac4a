"""Where the push plane's audits cost a step (issue 69, item 4): a discrete-event model of one
step of `bench/audit_cost.py`'s workload, for a machine too loaded to time it (a model, not a
measurement: the figure that counts is `bench/audit_cost.py` on a quiet machine).

    .venv/bin/python bench/audit_tail_model.py [--steps N] [--seed N] [--forward S] [--backward S]
        [--commit S]

Modelled: 4 stages x 3 replicas, each replica one worker (calls run whole, one at a time); 8
microbatches pushed at once, each through one replica a stage (the least loaded, ties drawn),
forward up and backward down, a hop between calls. After its push answers, a microbatch's audit
fetches the commitments, then, for each stage drawn (`audit_fraction`) or whose replica's
contribution the coordinator drew (`fraction / (2 - fraction)` a replica a step: two auditors),
a record and the stage's forward and backward again on other replicas. Printed, for a
re-execution's place in its auditor's queue (`fifo`; `ahead` of the pushes queued, as
`Worker.run_ahead`; `behind` them; `split`, as built: a late audit's in turn, one that gates its
microbatch's report ahead, `stage_server.replica.answering`; `bystep`: a late audit's in turn
only where its auditor's step has moved past the audit's, else ahead, what the request's step
alone could tell), seconds a step with audits on against off:
- `on/off`: the step's microbatches end with their audits, the commit (`--commit` seconds)
  follows (the rule before issue 69's item 4: a liar banned before its work commits);
- `overlapping`: the audits overlapping the commit (the verdicts gating the apply instead);
- `all late`: the rule now (`client.audit.late_audits`), steps modelled one after another: a
  microbatch is reported as its push answers, its audit running on through the commit and the
  next step (a contribution's digests judged when they come); `late` counts the audits run so,
  `cut` those not ended by the end of the next step's commit (their bound);
- `answers late`: as `all late`, but a microbatch with a contribution drawn on its path waits
  for its audit (its digests judged at the step's round): what deferring the answers' audits
  alone would give.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

STAGES, REPLICAS, MICROBATCHES = 4, 3, 8
HOP, COMMITMENTS, RECORD = 0.004, 0.003, 0.010  # seconds: a call's hop, the audit's RPCs
POLICIES = ("fifo", "ahead", "behind", "split", "bystep")


@dataclass(frozen=True)
class Costs:
    forward: float  # a stage's forward of one microbatch (seconds)
    backward: float
    fraction: float  # `[trust] audit_fraction`


@dataclass(frozen=True)
class Step:
    pushed: float  # the last push answered
    audited: float  # the last audit ended


def step(costs: Costs, policy: str, audits: bool, rng: random.Random) -> Step:
    """One step's microbatches, pushed and (with `audits`) audited, on idle replicas."""
    run = simulate(costs, policy, audits, rng, steps=1, commit=0.0, deferred=False)
    return Step(run.pushed[0], run.audited[0])


@dataclass
class _Sim:
    pushed: list[float]  # per step, its last push answered (seconds since the run began)
    audited: list[float]  # per step, its last audit ended
    ends: list[float]  # per step, its commit's end
    late: int = 0
    cut: int = 0


def simulate(
    costs: Costs,
    policy: str,
    audits: bool,
    rng: random.Random,
    *,
    steps: int,
    commit: float,
    deferred: bool,
    contributions_wait: bool = True,
) -> _Sim:
    """`steps` steps, one after another on the same replicas: a step's pushes start when the
    commit before it ends (`commit` seconds from its last microbatch reported). A microbatch is
    reported once its audit ends, or (`deferred`, the rule of issue 69's item 4) as soon as its
    push answers unless a contribution drawn is on its path (its digests are judged at the
    step's round; not `contributions_wait`: those too, as if the round judged them late); a late
    audit goes on through the commit and the next step, its re-executions queued at its auditors
    like any, and is cut (counted) where it has not ended by the end of the next step's
    commit."""
    events: list[tuple[float, int, Callable[[], None]]] = []
    order = itertools.count()
    now = 0.0
    Replica = tuple[int, int]
    queues: dict[Replica, list[tuple[int, int, float, Callable[[], None]]]] = {
        (k, r): [] for k in range(STAGES) for r in range(REPLICAS)
    }
    busy = dict.fromkeys(queues, False)
    load = dict.fromkeys(queues, 0)
    applied = [0]  # the steps whose commit has ended (each replica's update applied)

    def rank(redo: bool, late: bool, n: int) -> int:
        """A call's place in its replica's queue (0 first; within one, as they came): a push's,
        or a re-execution of step `n`'s audit (`late`: its microbatch reported already)."""
        if not redo or policy == "fifo":
            return 1
        if policy in ("split", "bystep"):
            turn = late and (policy == "split" or n < applied[0])
            return 1 if turn else 0
        return {"ahead": 0, "behind": 2}[policy]

    f, b = costs.forward, costs.backward
    share = costs.fraction / (2 - costs.fraction)
    sim = _Sim([0.0] * steps, [0.0] * steps, [0.0] * steps)
    reported = [0] * steps
    pending: dict[int, set[int]] = {n: set() for n in range(steps)}  # late audits still out
    cut: set[tuple[int, int]] = set()

    def at(t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(events, (t, next(order), fn))

    def submit(
        rep: Replica,
        seconds: float,
        done: Callable[[], None],
        redo: tuple[bool, int] | None = None,
    ) -> None:
        """`redo`: a re-execution's (late, its step); None: a push's."""
        place = rank(False, False, 0) if redo is None else rank(True, *redo)
        heapq.heappush(queues[rep], (place, next(order), seconds, done))
        load[rep] += 1
        start(rep)

    def start(rep: Replica) -> None:
        if busy[rep] or not queues[rep]:
            return
        _, _, seconds, done = heapq.heappop(queues[rep])
        busy[rep] = True

        def end() -> None:
            busy[rep] = False
            load[rep] -= 1
            done()
            start(rep)

        at(now + seconds, end)

    def least_loaded(k: int) -> Replica:
        low = min(load[(k, r)] for r in range(REPLICAS))
        return (k, rng.choice([r for r in range(REPLICAS) if load[(k, r)] == low]))

    def redo(
        k: int,
        rep: Replica,
        done: Callable[[], None],
        live: Callable[[], bool],
        asked: tuple[bool, int],
    ) -> None:
        """Stage `k` of an audit redone on `rep`; `asked`: the audit's (late, step)."""
        if not live():  # cut meanwhile: nothing more of it is asked
            return
        if k == STAGES - 1:
            submit(rep, f + b, lambda: at(now + HOP, done), asked)
            return

        def backward() -> None:
            if live():  # cut between its forward and its backward: the backward is not asked
                submit(rep, b, lambda: at(now + HOP, done), asked)

        submit(rep, f, lambda: at(now + HOP, backward), asked)

    def report(n: int) -> None:
        reported[n] += 1
        if reported[n] == MICROBATCHES:
            at(now + commit, functools.partial(committed, n))

    def committed(n: int) -> None:
        sim.ends[n] = now
        applied[0] = n + 1
        for i in sorted(pending.get(n - 1, ())):  # past their bound: cut
            cut.add((n - 1, i))
            sim.cut += 1
        pending[n - 1] = set()
        if n + 1 < steps:
            begin(n + 1)

    def audit(n: int, i: int, path: Sequence[Replica], drawn: set[Replica]) -> None:
        sim.pushed[n] = max(sim.pushed[n], now)
        jobs = []
        if audits:
            jobs = [(k, rep, 1) for k, rep in enumerate(path) if rng.random() < costs.fraction]
            jobs += [(k, rep, 2) for k, rep in enumerate(path) if rep in drawn]
        late = deferred and not (contributions_wait and any(rep in drawn for rep in path))
        if late:
            report(n)
        if not jobs:
            sim.audited[n] = max(sim.audited[n], now + (COMMITMENTS if audits else 0.0))
            if not late:
                at(now + (COMMITMENTS if audits else 0.0), functools.partial(report, n))
            return
        if late:
            sim.late += 1
            pending[n].add(i)
        left = [sum(m for _, _, m in jobs)]

        def live() -> bool:
            return (n, i) not in cut

        def one_done() -> None:
            left[0] -= 1
            if not left[0] and live():
                sim.audited[n] = max(sim.audited[n], now)
                pending[n].discard(i)
                if not late:
                    report(n)

        for k, rep, m in jobs:
            others = [(k, r) for r in range(REPLICAS) if (k, r) != rep]
            for auditor in rng.sample(others, m):
                at(
                    now + COMMITMENTS + RECORD + HOP,
                    functools.partial(redo, k, auditor, one_done, live, (late, n)),
                )

    def push(n: int, i: int, drawn: set[Replica]) -> None:
        path: list[Replica] = []

        def up(k: int) -> None:
            rep = least_loaded(k)
            path.append(rep)
            if k == STAGES - 1:
                submit(rep, f + b, lambda: at(now + HOP, lambda: down(k - 1)))
            else:
                submit(rep, f, lambda: at(now + HOP, lambda: up(k + 1)))

        def down(k: int) -> None:
            if k < 0:
                audit(n, i, path, drawn)
            else:
                submit(path[k], b, lambda: at(now + HOP, lambda: down(k - 1)))

        up(0)

    def begin(n: int) -> None:
        drawn = {rep for rep in queues if audits and rng.random() < share}
        for i in range(MICROBATCHES):
            at(now, functools.partial(push, n, i, drawn))

    begin(0)
    while events:
        now, _, fn = heapq.heappop(events)
        fn()
    return sim


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps modelled a policy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--forward", type=float, default=0.060, help="a stage's forward, s")
    parser.add_argument("--backward", type=float, default=0.120, help="a stage's backward, s")
    parser.add_argument("--commit", type=float, default=0.150, help="a step's commit, s")
    parser.add_argument("--fraction", type=float, default=0.045, help="audit_fraction")
    args = parser.parse_args(argv)
    costs = Costs(args.forward, args.backward, args.fraction)
    print(
        f"{'queue':<7} {'off s':>7} {'on s':>7} {'on/off':>7} {'overlapping':>12} "
        f"{'answers late':>13} {'all late':>9} {'late':>6} {'cut':>6}"
    )
    for policy in POLICIES:
        rng = random.Random(args.seed)
        off = statistics.fmean(step(costs, policy, False, rng).pushed for _ in range(args.steps))
        on = [step(costs, policy, True, rng) for _ in range(args.steps)]
        waits = statistics.fmean(s.audited for s in on) + args.commit
        overlaps = statistics.fmean(max(s.pushed + args.commit, s.audited) for s in on)
        base = off + args.commit
        answers = simulate(
            costs, policy, True, rng, steps=args.steps, commit=args.commit, deferred=True
        )
        run = simulate(
            costs,
            policy,
            True,
            rng,
            steps=args.steps,
            commit=args.commit,
            deferred=True,
            contributions_wait=False,
        )
        cut = f"{run.cut / run.late:.2%}" if run.late else "-"
        print(
            f"{policy:<7} {base:>7.3f} {waits:>7.3f} {waits / base:>7.3f} "
            f"{overlaps / base:>12.3f} {answers.ends[-1] / args.steps / base:>13.3f} "
            f"{run.ends[-1] / args.steps / base:>9.3f} {run.late:>6} {cut:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
