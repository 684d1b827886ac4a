"""Poison-proofing by re-execution (issue 55): how soon an audited job catches a replica that
lies, whether the replay leaves the honest run's model, and what the audits cost, against a run
without audits measured in the same run.

    .venv/bin/python bench/poison.py [--quick] [--trials N] [--fraction F] [--honest-steps N]
                                     [--planes relay,push] [--only attacks|honest]

A float64 job of 4 stages x 3 replicas on the carry plane (real gRPC servers in this process),
one hostile replica per stage (a `SWARM_FAULTS` hostile point, `swarm.ops.poison`: finite wrong
activations or input gradients, every step or one step in `--period`). Each trial trains until
the ban (or the job's end) with `[trust] audit_fraction = F` (default: the job default); the
first trial of each attack trains to the end and is compared with `swarm local` (the largest
difference, float64). Then an honest
job trains `--honest-steps` steps with audits and without: false accusations, the audits' extra
compute (re-executed stage computations over the training's own) and the wall-time ratio; a
false accusation (a ban in the honest job) fails the run (exit status 1). `--only honest` runs the
honest job alone (issue 55's 1,000 steps on the CPU), `--only attacks` the attacks alone.
Each of `--planes` gets its table: the carry plane (`relay`) and the push plane (`push`, with one
more attack: `poison-sent-outputs`, a replica that commits to its honest outputs and sends others).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads: no idle-connection notes

from prometheus_client import CollectorRegistry  # noqa: E402

from client.metrics import TrainerMetrics  # noqa: E402
from client.trainer import PipelineTrainer  # noqa: E402
from scheduler.coordinator import LocalCoordinator, gather_state  # noqa: E402
from stage_server.server import RunningStageServer, StageServerOptions, start_stage_server  # noqa: E402
from swarm.job.config import JobConfig, load_job  # noqa: E402
from swarm.job.fingerprint import fingerprint  # noqa: E402
from swarm.job.schema import TrustConfig  # noqa: E402
from swarm.model.reference import train_local  # noqa: E402
from swarm.ops.faults import parse_faults  # noqa: E402
from swarm.ops.poison import Poison  # noqa: E402
from swarm.rpc.lease import Replica  # noqa: E402

STAGES, REPLICAS = 4, 3
HEADER = (
    f"{'attack (SWARM_FAULTS)':<26} {'trials':>6} {'caught<=10':>12} {'mean to catch':>14} "
    f"{'max':>10} {'vs local':>12}"
)


def job_file(
    directory: Path, steps: int, fraction: float, name: str, plane: str = "relay"
) -> JobConfig:
    path = directory / f"{name}.toml"
    path.write_text(f"""name = "{name}"
[model]
kind = "gpt"
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 2
seq_len = 16
[data]
kind = "synthetic"
[training]
stages = {STAGES}
microbatch_size = 4
target_batch_size = 16
steps = {steps}
seed = 0
dtype = "float64"
checkpoint_every = 0
[optimizer]
kind = "adamw"
lr = 1e-2
[compression]
wire = "none"
[runtime]
data_plane = "{plane}"
[trust]
audit_fraction = {fraction}
""")
    return load_job(path)


class Run:
    """One job on its own servers: trained until it ends, or `until_ban`, then closed."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job
        self.servers: list[list[RunningStageServer]] = []
        self.metrics = TrainerMetrics(fingerprint(job), CollectorRegistry())

    def members(self) -> list[list[Replica]]:
        return [[Replica(s.address, s.address) for s in stage] for stage in self.servers]

    async def train(
        self, poison: str = "", *, until_ban: bool = False
    ) -> tuple[LocalCoordinator, float]:
        for k in range(STAGES):
            made = [
                await start_stage_server(self.job, StageServerOptions(stage=k))
                for _ in range(REPLICAS)
            ]
            if poison:
                made[0].servicer.poison = Poison.of(parse_faults(poison))
            self.servers.append(made)
        coordinator = LocalCoordinator(self.job, fingerprint(self.job), self.members)
        trainers = [
            PipelineTrainer(self.job, coordinator, metrics=self.metrics, seed=i) for i in range(2)
        ]
        started = time.perf_counter()
        await coordinator.start()
        runs = [asyncio.create_task(t.run()) for t in trainers]
        done = asyncio.create_task(coordinator.finished.wait())
        try:
            while not done.done() and not (until_ban and coordinator.bans.banned):
                await asyncio.wait([done], timeout=0.05)
            seconds = time.perf_counter() - started
        finally:
            for task in [*runs, done]:
                task.cancel()
            await asyncio.gather(*runs, done, return_exceptions=True)
            for t in trainers:
                await t.close()
        return coordinator, seconds

    async def close(self, coordinator: LocalCoordinator) -> None:
        await coordinator.close()
        for stage in self.servers:
            for s in stage:
                await s.stop()


def poisoned_steps(poison: str, through: int) -> int:
    """How many of steps 0..through the hostile replicas lied at."""
    lies = Poison.of(parse_faults(poison)).faults
    return sum(1 for s in range(through + 1) if any(f.hostile_at(f.point, s) for f in lies))


async def attack(
    directory: Path, poison: str, trials: int, steps: int, fraction: float, plane: str = "relay"
) -> str:
    caught, to_catch, max_diff = 0, [], float("nan")
    for trial in range(trials):
        job = job_file(directory, steps, fraction, f"poison{trial}", plane)
        run = Run(job)
        whole = trial == 0  # trained to the end and compared with `swarm local`
        coordinator, _ = await run.train(poison, until_ban=not whole)
        try:
            if coordinator.bans.caught_at:
                step = min(coordinator.bans.caught_at.values())
                n = poisoned_steps(poison, step)
                caught += n <= 10
                to_catch.append(n)
            if whole and coordinator.error is None and coordinator.finished.is_set():
                state, reference = await gather_state(coordinator), train_local(job).state_dict()
                max_diff = max(float((state[k] - reference[k]).abs().max()) for k in reference)
        finally:
            await run.close(coordinator)
    mean = sum(to_catch) / len(to_catch) if to_catch else float("nan")
    return (
        f"{poison:<26} {trials:>6} {caught / trials:>12.2f} {mean:>14.1f} "
        f"{max(to_catch, default=0):>10} {max_diff:>12.2e}"
    )


async def honest(directory: Path, steps: int, fraction: float, plane: str = "relay") -> str:
    timings, share, accused, difference = {}, 0.0, 0, 0.0
    for f in (0.0, fraction):  # the same job, without audits and with
        run = Run(job_file(directory, steps, f, f"honest{int(f * 100)}", plane))
        coordinator, seconds = await run.train()
        try:
            assert coordinator.error is None and coordinator.finished.is_set(), coordinator.error
            timings[f] = seconds
            if f:
                m = run.metrics
                share = m.audit_runs._value.get() / max(1.0, m.stage_runs._value.get())
                accused = len(coordinator.bans.banned)
                difference = m.audit_difference._value.get()
        finally:
            await run.close(coordinator)
    ratio = timings[fraction] / timings[0.0]
    if accused:
        raise SystemExit(f"honest, {steps} steps: {accused} false accusation(s)")
    return (
        f"honest, {steps} steps: false accusations {accused}, extra compute {share:.1%} of the "
        f"stage computations, wall time {ratio:.2f}x the run without audits, largest honest "
        f"difference {difference:.1e}"
    )


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for plane in args.planes.split(","):
            print(f"{plane} plane: 4 stages x 3 replicas, audit_fraction {args.fraction}")
            if args.only != "honest":
                print("one hostile replica per stage")
                print(HEADER)
                poisons = [
                    "poison-outputs@0",
                    "poison-grad-inputs@0",
                    f"poison-outputs@1/{args.period}",
                    f"poison-grad-inputs@1/{args.period}",
                ]
                if plane == "push":  # says one thing, sends another: only the push plane can
                    poisons += ["poison-sent-outputs@0", f"poison-sent-outputs@1/{args.period}"]
                for poison in poisons:
                    line = await attack(
                        directory, poison, args.trials, args.steps, args.fraction, plane
                    )
                    print(line, flush=True)
            if args.only != "attacks":
                print(await honest(directory, args.honest_steps, args.fraction, plane), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few trials, a short period")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=TrustConfig().audit_fraction)
    parser.add_argument("--period", type=int, default=20, help="the sparse attack's period")
    parser.add_argument("--honest-steps", type=int, default=1000)
    parser.add_argument("--planes", default="relay,push", help="the data planes, in order")
    parser.add_argument("--only", choices=("attacks", "honest"), help="one half of the bench")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.period, args.honest_steps = 3, 3, 20
    # a trial's job is long enough for 10 poisoned steps and a margin
    args.steps = args.period * 12 + 2
    asyncio.run(main(args))
