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
a record and the stage's forward and backward again on other replicas. The step's microbatches
end with their audits; the commit (`--commit` seconds) follows. Printed, for a re-execution's
place in its auditor's queue (`fifo`; `ahead` of the pushes queued, as `Worker.run_ahead`;
`behind` them): seconds a step with audits on against off, as the step waits for its audits
now, and as it would if they overlapped the commit (the verdicts gating the apply instead).
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
POLICIES = ("fifo", "ahead", "behind")


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
    """One step's microbatches, pushed and (with `audits`) audited."""
    events: list[tuple[float, int, Callable[[], None]]] = []
    order = itertools.count()
    now = 0.0
    Replica = tuple[int, int]
    queues: dict[Replica, list[tuple[int, int, float, Callable[[], None]]]] = {
        (k, r): [] for k in range(STAGES) for r in range(REPLICAS)
    }
    busy = dict.fromkeys(queues, False)
    load = dict.fromkeys(queues, 0)
    rank = {"fifo": (1, 1), "ahead": (1, 0), "behind": (1, 2)}[policy]  # (push, re-execution)

    def at(t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(events, (t, next(order), fn))

    def submit(rep: Replica, seconds: float, done: Callable[[], None], redo: bool) -> None:
        heapq.heappush(queues[rep], (rank[redo], next(order), seconds, done))
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

    f, b = costs.forward, costs.backward
    share = costs.fraction / (2 - costs.fraction)
    drawn = {rep for rep in queues if audits and rng.random() < share}
    pushed: dict[int, float] = {}
    audited: dict[int, float] = {}

    def least_loaded(k: int) -> Replica:
        low = min(load[(k, r)] for r in range(REPLICAS))
        return (k, rng.choice([r for r in range(REPLICAS) if load[(k, r)] == low]))

    def redo(k: int, rep: Replica, done: Callable[[], None]) -> None:
        if k == STAGES - 1:
            submit(rep, f + b, lambda: at(now + HOP, done), True)
        else:
            then = lambda: at(now + HOP, lambda: submit(rep, b, lambda: at(now + HOP, done), True))  # noqa: E731
            submit(rep, f, then, True)

    def audit(i: int, path: Sequence[Replica]) -> None:
        pushed[i] = now
        if not audits:
            audited[i] = now
            return
        jobs = [(k, rep, 1) for k, rep in enumerate(path) if rng.random() < costs.fraction]
        jobs += [(k, rep, 2) for k, rep in enumerate(path) if rep in drawn]
        left = [sum(n for _, _, n in jobs)]
        if not left[0]:
            at(now + COMMITMENTS, lambda: audited.__setitem__(i, now))
            return

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                audited[i] = now

        for k, rep, n in jobs:
            others = [(k, r) for r in range(REPLICAS) if (k, r) != rep]
            for auditor in rng.sample(others, n):
                at(now + COMMITMENTS + RECORD + HOP, functools.partial(redo, k, auditor, one_done))

    def push(i: int) -> None:
        path: list[Replica] = []

        def up(k: int) -> None:
            rep = least_loaded(k)
            path.append(rep)
            if k == STAGES - 1:
                submit(rep, f + b, lambda: at(now + HOP, lambda: down(k - 1)), False)
            else:
                submit(rep, f, lambda: at(now + HOP, lambda: up(k + 1)), False)

        def down(k: int) -> None:
            if k < 0:
                audit(i, path)
            else:
                submit(path[k], b, lambda: at(now + HOP, lambda: down(k - 1)), False)

        up(0)

    for i in range(MICROBATCHES):
        at(0.0, functools.partial(push, i))
    while events:
        now, _, fn = heapq.heappop(events)
        fn()
    return Step(max(pushed.values()), max(audited.values()))


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
    print(f"{'queue':<7} {'off s':>7} {'on s':>7} {'on/off':>7} {'overlapping the commit':>23}")
    for policy in POLICIES:
        rng = random.Random(args.seed)
        off = statistics.fmean(step(costs, policy, False, rng).pushed for _ in range(args.steps))
        on = [step(costs, policy, True, rng) for _ in range(args.steps)]
        waits = statistics.fmean(s.audited for s in on) + args.commit
        overlaps = statistics.fmean(max(s.pushed + args.commit, s.audited) for s in on)
        base = off + args.commit
        print(
            f"{policy:<7} {base:>7.3f} {waits:>7.3f} {waits / base:>7.3f} {overlaps / base:>23.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
