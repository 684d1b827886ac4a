"""Fault injection as data: `(target, point, step)` triples that kill real processes with SIGKILL,
or make a computation raise as a device out of memory would.

A stage server started with `SWARM_FAULTS="backward@3,averaging@5"` kills itself the first time
it reaches that point while serving that step: mid-request, so the caller sees a dead peer exactly
where the fault says. The raising points (`forward-oom`, `backward-oom`, `averaging-oom`) raise an
out-of-memory error inside that computation instead (`due`, once each), and the process lives on:
a device failure in a real process, for tests and benchmarks. The hostile points make the process
lie from that step on (`poisoning`), or one step in PERIOD from it (`point@step/PERIOD`): in its
pool's averaging (`poison-sum`, `poison-forge`, `poison-grad`, `poison-bent`, `poison-nan`,
`lie-report`;
`stage_server.averaging.hostile`) or in its stage compute (`poison-outputs`,
`poison-grad-inputs`: finite wrong numbers sent on; `poison-digest`: an audit's gradient digest;
`swarm.ops.poison`), and the process serves on: what the audits and the pool's checks must catch
(issue 55). A stage server reads its SWARM_FAULTS when it starts (`arm`): a malformed one stops
it there, not at the first fault point it reaches. `idle` faults (between calls) and the
roles `scheduler`, `trainer` and `broker` are killed from outside by `FaultPlan.due`'s caller
(the test harness, `swarm demo`) when the job reaches the step; the target `*` (`ANY_REPLICA`)
leaves the choice of replica to it.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from swarm.errors import ConfigError

__all__ = [
    "ANY_REPLICA",
    "ENV",
    "HOSTILE",
    "RAISING",
    "Fault",
    "FaultPlan",
    "Point",
    "arm",
    "armed",
    "due",
    "maybe_die",
    "parse_faults",
    "poisoning",
    "refuses_handover",
]

log = logging.getLogger(__name__)
ENV = "SWARM_FAULTS"
ROLES = ("scheduler", "trainer", "broker")
ANY_REPLICA = "*"  # a target the caller picks when the fault is due (the demo: a spare replica)


class Point(enum.StrEnum):
    FORWARD = "forward"  # receiving a Forward (or the forward of ForwardBackward)
    BACKWARD = "backward"  # after computing a Backward, before answering it
    AVERAGING = "averaging"  # inside a pool's averaging round
    STATE_DOWNLOAD = "state-download"  # while streaming its state to a joining replica
    IDLE = "idle"  # between calls: killed from outside
    # Raising, not killing: an out-of-memory error inside the computation, once (`due`).
    FORWARD_OOM = "forward-oom"  # a Forward's forward (or ForwardBackward's)
    BACKWARD_OOM = "backward-oom"  # inside the backward, once a gradient reached the sums
    AVERAGING_OOM = "averaging-oom"  # a pool's averaging round, before this replica sends
    # Hostile, from the step on (`poisoning`; `stage_server.averaging.hostile`): issue 55's
    # poisoners as real processes, for tests and benchmarks.
    POISON_SUM = "poison-sum"  # an owner answers its part's sums plus 1e4
    POISON_FORGE = "poison-forge"  # ... its sums times 1 - 1e-3: within every norm check
    POISON_GRAD = "poison-grad"  # a replica contributes its gradient sums times 1e4
    # ... its gradient sums bent within the norm bound (element i times 1 + cos i)
    POISON_BENT = "poison-bent"
    POISON_NAN = "poison-nan"  # ... its gradient sums with a NaN in them
    POISON_OUTPUTS = "poison-outputs"  # a Forward's outputs sent wrong (`swarm.ops.poison`)
    POISON_GRAD_INPUTS = "poison-grad-inputs"  # a Backward's input gradient sent wrong
    # the push plane's outputs sent on wrong, while it commits to the honest ones' digest
    POISON_SENT_OUTPUTS = "poison-sent-outputs"
    # an auditor's digest of a contribution's gradient answered wrong, its re-execution honest
    POISON_DIGEST = "poison-digest"
    # a replica sends honest values but reports a wrong r·x (and q·x) of what it sent to the
    # other owners' parts: its word against theirs (`SumCheck.received_dots`)
    LIE_REPORT = "lie-report"
    # a replica averages and reports honestly but answers PREPARE with a NaN squared norm of
    # its pool's average: one member's word to end another submitter's job
    LIE_NORM = "lie-norm"
    # a replica sends a NaN in the values of one other owner's part but reports finite words of
    # what it sent there (r·x, its norm): the NaN seen by that owner alone, its word against the
    # sender's, and every member's sum of that part NaN
    LIE_NAN = "lie-nan"
    # Refusing: this process refuses every tensor handed over to it, as a handle it cannot open
    # (b8f54b2's CUDA handover did, for torch 2.11's; issue 63): what the sender and the
    # trainer must survive, or at least name (`refuses_handover`). Its step is not read (a
    # take knows none): `handover-refuse@0`; the first push to each replica is on the wire.
    HANDOVER_REFUSE = "handover-refuse"


RAISING = frozenset({Point.FORWARD_OOM, Point.BACKWARD_OOM, Point.AVERAGING_OOM})
HOSTILE = frozenset(
    {
        Point.POISON_SUM,
        Point.POISON_FORGE,
        Point.POISON_GRAD,
        Point.POISON_BENT,
        Point.POISON_NAN,
        Point.POISON_OUTPUTS,
        Point.POISON_GRAD_INPUTS,
        Point.POISON_SENT_OUTPUTS,
        Point.POISON_DIGEST,
        Point.LIE_REPORT,
        Point.LIE_NORM,
        Point.LIE_NAN,
    }
)


@dataclass(frozen=True)
class Fault:
    target: str  # a peer id / replica name, or a role: scheduler, trainer, broker
    point: Point
    step: int
    period: int = 1  # a hostile point's: it lies at `step`, then every `period` steps after

    def __post_init__(self) -> None:
        if self.period < 1 or (self.period > 1 and self.point not in HOSTILE):
            raise ValueError(f"a period of {self.period} at {self.point}")

    def hostile_at(self, point: Point, step: int) -> bool:
        """Whether this fault makes its process lie at `point` (one of `HOSTILE`) in `step`."""
        return point == self.point and step >= self.step and (step - self.step) % self.period == 0

    def __str__(self) -> str:
        at = f"{self.point}@{self.step}" + (f"/{self.period}" if self.period > 1 else "")
        return f"{self.target}:{at}" if self.target else at


def parse_faults(text: str) -> list[Fault]:
    """`target:point@step[/period],...` (target optional inside a process's own SWARM_FAULTS;
    a period only at a hostile point)."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        target, _, rest = item.rpartition(":")
        point, _, when = rest.partition("@")
        step, slash, period = when.partition("/")
        try:
            faults.append(Fault(target, Point(point), int(step), int(period) if slash else 1))
        except ValueError:
            allowed = ", ".join(p.value for p in Point)
            raise ConfigError(
                f"fault {item!r}: use [target:]point@step, or point@step/period (period >= 1) "
                f"at a hostile point ({', '.join(sorted(HOSTILE))}); point one of {allowed}"
            ) from None
    return faults


_armed: list[Fault] | None = None


def arm(text: str | None = None) -> list[Fault]:
    """This process's own faults from `text` (default: its SWARM_FAULTS), read now: a stage
    server's start, so a malformed spec stops it with `ConfigError` before it serves anything.
    Arming again replaces the faults (and re-arms a raising point that fired)."""
    global _armed
    text = os.environ.get(ENV, "") if text is None else text
    try:
        faults = parse_faults(text)
    except ConfigError as e:
        raise ConfigError(f"{ENV}={text!r}: {e}") from None
    _armed = faults
    if faults:
        log.warning("%s: faults armed in this process: %s", ENV, ", ".join(map(str, faults)))
    return list(faults)


def _faults() -> list[Fault]:
    return _armed if _armed is not None else arm()


def armed() -> list[Fault]:
    """This process's faults still to come (a raising one that fired is spent)."""
    return list(_faults())


def maybe_die(point: Point, step: int) -> None:
    """Called at each fault point of a stage server: SIGKILL this process if a fault says so."""
    if any(f.point == point and f.step == step for f in _faults()):
        log.warning("fault injected: %s@%d; killing this process", point, step)
        os.kill(os.getpid(), signal.SIGKILL)


def poisoning(point: Point, step: int) -> bool:
    """Whether this process acts hostile at `point` (one of `HOSTILE`) in `step`: from the
    fault's step on, every step or one in its period (a hostile peer does not stop at one)."""
    return any(f.hostile_at(point, step) for f in _faults())


def refuses_handover() -> bool:
    """Whether this process refuses the tensors handed over to it (`HANDOVER_REFUSE`)."""
    return any(f.point == Point.HANDOVER_REFUSE for f in _faults())


def due(point: Point, step: int, peer: str = "") -> bool:
    """Whether a raising fault at `point` of `step` fires now: True once, the first time it is
    asked (the fault is spent then), so a retry of the computation goes through. A fault that
    names a target fires only where the caller says it is that `peer` (servers sharing one
    process, as in tests); one without, wherever this process reaches the point."""
    faults = _faults()
    mine = (f for f in faults if f.point == point and f.step == step)
    fault = next((f for f in mine if not f.target or f.target == peer), None)
    if fault is None:
        return False
    faults.remove(fault)
    log.warning("fault injected: %s@%d; raising out of memory", point, step)
    return True


class FaultPlan:
    """The faults to trigger from outside, each once, as the job's step advances."""

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.pending: list[Fault] = []
        for fault in faults:
            self.add(fault)

    def add(self, fault: Fault) -> None:
        """Plan one more (a process's own faults are left to `maybe_die`). A fault taken from
        `due` that could not be carried out yet goes back in this way, due again at once."""
        if fault.point == Point.IDLE or fault.target in ROLES:
            self.pending.append(fault)

    def due(self, step: int) -> list[Fault]:
        """The faults whose step the job has reached, each returned once."""
        ready = [f for f in self.pending if f.step <= step]
        self.pending = [f for f in self.pending if f.step > step]
        return ready

    @staticmethod
    def for_process(faults: Iterable[Fault], target: str) -> str:
        """The SWARM_FAULTS value for the process named `target` (its in-process faults)."""
        return ",".join(
            str(Fault("", f.point, f.step, f.period))
            for f in faults
            if f.target == target and f.point != Point.IDLE
        )
