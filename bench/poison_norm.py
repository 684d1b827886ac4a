"""What one hostile replica per pool does to a job's loss, with the norm bound and without it
(issue 55, item 4: "with auditing off, the norm bound alone keeps the loss of a run with one
hostile replica per pool within 2% of the honest run at equal steps").

    .venv/bin/python bench/poison_norm.py [--steps 100] [--scale 1e4] [--quick]

A float64 job of 4 stages x 3 replicas (real stage servers on real ports, in this process, so
one replica of every stage can be made hostile), audits off (`audit_fraction = 0`, the tests'
default). Runs at equal steps: honest; a hostile replica per stage that multiplies the gradient
sums it contributes to its pool's averaging by `--scale`, every step (finite, so no check of
form refuses it), with `[trust] clip = "off"` and with the default `"norm_bound"`; and, with the
bound, the lies it lets through by design: sums bent within it (element i times 1 + cos i, as
`poison-bent`) and wrong activations and input gradients (`poison-outputs` and
`poison-grad-inputs`, `swarm.ops.poison`), which only the audits catch. Printed: each run's
validation loss of its final model, against the honest run's (a ratio measured in the same
run), and how many contributions the bound refused: the coordinator's own counter
(`swarm_coordinator_refused_contributions_total`).

The target (issue 55): the x`--scale` run with the bound within 2% of the honest run's loss,
the bound having refused a contribution (a run it never judged backs nothing); at least 100 steps
(`--quick`: fewer, a smoke run that is judged the same way and says so). The exit status is 1
when it is missed, 0 when met. The other rows are what the bound lets through by design (the
audits' to catch, docs/jobs.md): printed, not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.coordinator import LocalCoordinator, gather_state  # noqa: E402
from swarm.job.config import JobConfig  # noqa: E402
from swarm.job.fingerprint import fingerprint  # noqa: E402
from swarm.model.data import make_val_data  # noqa: E402
from swarm.model.reference import evaluate  # noqa: E402
from swarm.model.transformer import build_model  # noqa: E402
from swarm.ops.faults import parse_faults  # noqa: E402
from swarm.ops.poison import Poison  # noqa: E402
from tests.support.inprocess import Swarm  # noqa: E402
from tests.support.jobs import make_job  # noqa: E402

Hostile = Callable[[Swarm], None]
TARGET = 0.02  # issue 55: within 2% of the honest run's loss with the norm bound alone
MIN_STEPS = 100  # issue 65: fewer steps are not a run the target can be read off


def _contributing(change: Callable[[torch.Tensor], object]) -> Hostile:
    """The last replica of every stage changes what it contributes to its pool's rounds."""

    def hostile(swarm: Swarm) -> None:
        for stage in swarm.servers:
            committer = stage[-1].servicer._commits
            honest = committer._average

            async def changed(c: Any, sums: list[torch.Tensor], *a: Any, _h: Any = honest) -> Any:
                for t in sums:
                    change(t)
                return await _h(c, sums, *a)

            setattr(committer, "_average", changed)  # noqa: B010 (a bench's hostile replica)

    return hostile


def _bent(t: torch.Tensor) -> None:
    t.mul_(torch.arange(t.numel(), dtype=torch.float64).cos_().add_(1).to(t.dtype).reshape(t.shape))


def _computing(lies: str) -> Poison:
    """The last replica of every stage answers its stage compute wrong (`swarm.ops.poison`),
    armed at its start."""
    return Poison.of(parse_faults(lies))


async def _run(job: JobConfig, hostile: Hostile | Poison | None) -> tuple[float, int]:
    """The final model's validation loss, and the contributions the norm bound refused (the
    coordinator's counter), of one run of `job`."""
    swarm = Swarm(job)
    try:
        await swarm.add_replicas(3, hostile if isinstance(hostile, Poison) else None)
        if hostile is not None and not isinstance(hostile, Poison):
            hostile(swarm)
        coordinator = LocalCoordinator(job, fingerprint(job), swarm.members)
        await swarm.train(coordinator, trainers=2)
        model = build_model(job, "cpu")
        model.load_state_dict(await gather_state(coordinator))
        refused = int(coordinator.metrics.refused._value.get())
        await coordinator.close()
        return evaluate(job, model, make_val_data(job), "cpu"), refused
    finally:
        await swarm.close()


def bounded(scale: float) -> str:
    """The judged row's name: the x`scale` contribution with the norm bound."""
    return f"x{scale:g}, norm_bound"


def judge(results: dict[str, tuple[float, int]], scale: float, steps: int) -> list[str]:
    """The targets `results` (row -> (validation loss, contributions refused)) missed: the
    x`scale` row with the bound more than 2% above the honest run's loss, or none refused (the
    bound judged nothing), or a run under 100 steps. Empty: every one met."""
    loss, refused = results[bounded(scale)]
    base = results["honest"][0]
    missed = []
    if not loss / base - 1 <= TARGET:  # NaN fails too
        missed.append(f"{bounded(scale)}: {loss / base:.4f}x the honest loss, past {1 + TARGET}x")
    if refused < 1:
        missed.append(f"{bounded(scale)}: the bound refused nothing (it judged nothing)")
    if steps < MIN_STEPS:
        missed.append(f"{steps} steps: under the {MIN_STEPS} the target is read at (a smoke run)")
    return missed


async def main(steps: int, scale: float) -> dict[str, tuple[float, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        training = {"steps": steps, "target_batch_size": 32, "checkpoint_every": 0}
        scaled = _contributing(lambda t: t.mul_(scale))
        bound = make_job(Path(tmp), "bound", training=training)
        runs: dict[str, tuple[JobConfig, Hostile | Poison | None]] = {
            "honest": (make_job(Path(tmp), "honest", training=training), None),
            f"x{scale:g}, clip off": (
                make_job(Path(tmp), "off", training=training, trust={"clip": "off"}),
                scaled,
            ),
            bounded(scale): (bound, scaled),
            "bent, norm_bound": (bound, _contributing(_bent)),
            "wrong compute, bound": (
                bound,
                _computing("poison-outputs@0,poison-grad-inputs@0"),
            ),
        }
        results = {name: await _run(job, hostile) for name, (job, hostile) in runs.items()}
    base = results["honest"][0]
    print(f"\n4 stages x 3 replicas, float64, {steps} steps, audits off; 1 hostile replica a stage")
    print(f"{'run':<22} {'val loss':>12} {'vs honest':>10} {'refused':>9}")
    for name, (loss, refused) in results.items():
        print(f"{name:<22} {loss:>12.6f} {loss / base:>10.4f} {refused:>9}")
    return results


def report(missed: list[str]) -> int:
    """The exit status: 1 when a target was missed (each said), 0 when all were met."""
    for m in missed:
        print(f"FAIL {m}")
    print("PASS within 2% with the norm bound alone" if not missed else "target missed")
    return 1 if missed else 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.ERROR)  # printed: errors only
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=MIN_STEPS)
    parser.add_argument("--scale", type=float, default=1e4)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 steps")
    args = parser.parse_args()
    steps = 12 if args.quick else args.steps
    sys.exit(report(judge(asyncio.run(main(steps, args.scale)), args.scale, steps)))
