"""Scheduler load: N trainers leasing and reporting microbatches as fast as they can against one
scheduler's job API (real gRPC, the real JobApiServicer, store and step coordinator), with no
stage compute: the replicas are the coordinator's in-memory fakes (`tests.support.replicas`),
which accumulate a receipt when a trainer reports a microbatch they hold and commit at once.

    .venv/bin/python bench/scheduler_load.py [--trainers 10,100,200,1000] [--seconds 10]
        [--stages 4] [--microbatches 4096] [--take 8] [--separate] [--json]

The scheduler runs in a process of its own; the trainers run as asyncio tasks in this one, each
with its own gRPC channel (as separate trainer processes would have), in a loop as
`client.trainer` runs with `--take` slots and no compute: lease up to `--take` microbatches (a
long poll), then report what is done and ask for as many next ones in the same call (`next`);
`--separate` reports and leases in two calls, as trainers did before. After a warm-up second,
for `--seconds`, it counts leases, reports (microbatches) and report calls, their latencies (p50,
p99), the steps committed, and the scheduler process's CPU time, and prints one row per trainer
count with the CPU cost per thousand reports relative to the first row: how the cost grows with
the number of trainers. Both processes share this machine's cores: the trainers' own CPU time is
part of the picture. Trainers that ask as fast as they can are a closed loop: each call's latency
is the number of trainers over the calls per second the scheduler answers (Little's law).
Target (issue 15, 2 cores): >= 5,000 reports/s with p99 < 50 ms at 200 trainers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from swarm.proto import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

JOB = """name = "load"
[model]
kind = "gpt"
vocab_size = 16
d_model = 8
n_layers = {blocks}
n_heads = 1
seq_len = 4
[training]
stages = {stages}
microbatch_size = 1
target_batch_size = {microbatches}
steps = 1000000
checkpoint_every = 0
[optimizer]
kind = "sgd"
lr = 0.1
[runtime]
lease_timeout_s = 60.0
"""
REPLICAS = 2  # per stage


# -- the scheduler's process ----------------------------------------------------------------------
def _serve(stages: int, microbatches: int, ready: Any) -> None:
    asyncio.run(_serving(stages, microbatches, ready))


async def _serving(stages: int, microbatches: int, ready: Any) -> None:
    from prometheus_client import CollectorRegistry

    from scheduler.coordinator import LocalCoordinator
    from scheduler.coordinator.metrics import CoordinatorMetrics
    from scheduler.job_api import JobApiServicer
    from scheduler.store import JobStore
    from swarm.job.config import parse_job
    from swarm.rpc.lease import Lease, MicrobatchResult, Working
    from tests.support.api import FakeControl
    from tests.support.replicas import FakeSwarm

    text = JOB.format(blocks=max(1, stages - 2), stages=stages, microbatches=microbatches)
    job = parse_job(text, ROOT)
    work = Path(tempfile.mkdtemp(prefix="swarm-load-"))
    store = JobStore(work / "jobs.sqlite")
    job_id = store.create(job.name, text, str(ROOT), job.training.steps).id
    swarm = FakeSwarm(job_id, stages)
    for k in range(stages):
        for r in range(REPLICAS):
            swarm.add(k, f"s{k}r{r}")
    steps = [0]

    def on_step(record: Any) -> None:
        steps[0] += 1

    coordinator = LocalCoordinator(
        job,
        job_id,
        swarm.members,
        connect=swarm.connect,
        on_step=on_step,
        metrics=CoordinatorMetrics(job_id, CollectorRegistry()),
    )
    await coordinator.start()

    class Control(FakeControl):
        """The job API's control over the one coordinator: a reported microbatch is first
        accumulated by the fake replicas named as its holders (what a stage server does)."""

        async def lease(
            self,
            job_id: str,
            trainer: str,
            count: int,
            *,
            wait_s: float = 0.0,
            working: Sequence[Working] = (),
        ) -> Lease:
            return await coordinator.lease(trainer, count, wait_s=wait_s, working=working)

        async def report(
            self,
            job_id: str,
            trainer: str,
            results: list[MicrobatchResult],
            released: list[int],
            failure: str | None = None,
        ) -> None:
            if released:
                await coordinator.release(trainer, released, failure)
            for result in results:
                for peer in result.holders.values():
                    swarm[peer].accumulate(result.index)
                await coordinator.report(trainer, result)

    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
        JobApiServicer(store, Control(store), data_root=work / "data"), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready.send((job_id, port))
    while True:  # until the parent asks, or kills it
        await asyncio.sleep(0.2)
        if ready.poll():
            ready.recv()
            ready.send(steps[0])


# -- the trainers ---------------------------------------------------------------------------------
async def _trainer(
    address: str,
    job: str,
    name: str,
    take: int,
    stages: int,
    until: float,
    out: dict[str, Any],
    separate: bool = False,
) -> None:
    """As `client.trainer` does with `take` slots and no compute: lease up to `take` (a long
    poll), then report what is done and ask for as many next ones in one call (`next`; with
    no compute, all of them are done at once); `separate`: a report call, then a lease call."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        replica = hash(name) % REPLICAS
        key = os.urandom(32)  # its own, as a trainer's (`scheduler.trainer_keys`)
        queue: list[Any] = []
        while time.monotonic() < until:
            if not queue:
                start = time.monotonic()
                lease = await stub.LeaseMicrobatches(
                    scheduler_pb2.SchedulerLeaseMicrobatchesRequest(
                        job=job, trainer=name, count=take, wait_s=1.0, trainer_key=key
                    ),
                    timeout=30,
                )
                if lease.tasks:
                    out["lease_ms"].append((time.monotonic() - start) * 1000)
                    out["leases"] += 1
                queue = list(lease.tasks)
                continue
            results = [
                scheduler_pb2.MicrobatchReport(
                    step=t.step,
                    index=t.index,
                    holders={k: f"s{k}r{replica}" for k in t.stages},
                    loss_sum=1.0 if stages - 1 in t.stages else None,
                    samples=1,
                )
                for t in queue
            ]
            ask = scheduler_pb2.SchedulerLeaseMicrobatchesRequest(
                job=job, trainer=name, count=len(queue), trainer_key=key
            )
            start = time.monotonic()
            request = scheduler_pb2.SchedulerReportMicrobatchesRequest(
                job=job,
                trainer=name,
                results=results,
                next=None if separate else ask,
                trainer_key=key,
            )
            answer = await stub.ReportMicrobatches(request, timeout=30)
            out["report_ms"].append((time.monotonic() - start) * 1000)
            out["reports"] += len(results)
            out["report_calls"] += 1
            if separate:
                start = time.monotonic()
                more = await stub.LeaseMicrobatches(ask, timeout=30)
                out["lease_ms"].append((time.monotonic() - start) * 1000)
            else:
                more = answer.lease
            if more.tasks:
                out["leases"] += 1
            queue = list(more.tasks)
        if queue:  # time is up: give back what is left, for the next round's trainers
            await stub.ReportMicrobatches(
                scheduler_pb2.SchedulerReportMicrobatchesRequest(
                    job=job, trainer=name, released=[t.index for t in queue], trainer_key=key
                ),
                timeout=30,
            )


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def _round(
    address: str,
    job: str,
    n: int,
    seconds: float,
    take: int,
    stages: int,
    pid: int,
    pipe: Any,
    separate: bool,
) -> dict[str, Any]:
    warm = {"lease_ms": [], "report_ms": [], "leases": 0, "reports": 0, "report_calls": 0}
    start = time.monotonic()
    await asyncio.gather(  # a warm-up second: channels connected, the coordinator busy
        *(
            _trainer(address, job, f"w{i}", take, stages, start + 1.0, warm, separate)
            for i in range(n)
        )
    )
    out: dict[str, Any] = {k: (v if isinstance(v, list) else 0) for k, v in warm.items()}
    out["lease_ms"], out["report_ms"] = [], []
    pipe.send("steps")
    steps0, cpu0, t0 = pipe.recv(), _cpu_seconds(pid), time.monotonic()
    until = t0 + seconds
    await asyncio.gather(
        *(_trainer(address, job, f"t{n}-{i}", take, stages, until, out, separate) for i in range(n))
    )
    elapsed = time.monotonic() - t0
    pipe.send("steps")
    steps1, cpu1 = pipe.recv(), _cpu_seconds(pid)
    reports = out["reports"]
    return {
        "trainers": n,
        "seconds": elapsed,
        "leases_per_s": out["leases"] / elapsed,
        "reports_per_s": reports / elapsed,
        "report_calls_per_s": out["report_calls"] / elapsed,
        "lease_p50_ms": _pct(out["lease_ms"], 50),
        "lease_p99_ms": _pct(out["lease_ms"], 99),
        "report_p50_ms": _pct(out["report_ms"], 50),
        "report_p99_ms": _pct(out["report_ms"], 99),
        "steps_per_s": (steps1 - steps0) / elapsed,
        "scheduler_cpu_ms_per_1k_reports": 1e6 * (cpu1 - cpu0) / reports if reports else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", default="10,100,200,1000", help="trainer counts, one run each")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per run")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (2 replicas each)")
    p.add_argument("--microbatches", type=int, default=4096, help="microbatches per step")
    p.add_argument(
        "--take", type=int, default=8, help="a trainer's slots (max_in_flight auto, stages silent)"
    )
    p.add_argument(
        "--separate",
        action="store_true",
        help="report, then lease, in two calls (the trainer before `next` existed)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.trainers.split(",")]

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(args.stages, args.microbatches, there), daemon=True)
    server.start()
    try:
        if not here.poll(120):
            raise SystemExit("the scheduler did not start")
        job, port = here.recv()
        address = f"127.0.0.1:{port}"
        rows = []
        for n in counts:
            row = asyncio.run(
                _round(
                    address,
                    job,
                    n,
                    args.seconds,
                    args.take,
                    args.stages,
                    server.pid,
                    here,
                    args.separate,
                )
            )
            rows.append(row)
            print(f"[load] {n} trainers: {row['reports_per_s']:.0f} reports/s", file=sys.stderr)
    finally:
        server.kill()
        server.join(10)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    base = rows[0]["scheduler_cpu_ms_per_1k_reports"]
    print(
        f"scheduler load: {args.stages} stages x {REPLICAS} fake replicas, "
        f"{args.microbatches} microbatches per step, leases of up to {args.take}, "
        f"{args.seconds:g} s per run, {os.cpu_count()} cores shared by both processes"
    )
    print(
        f"{'trainers':>8} {'leases/s':>9} {'reports/s':>10} {'calls/s':>8} {'lease p50':>10} "
        f"{'p99':>7} {'report p50':>11} {'p99':>7} {'steps/s':>8} {'cpu ms/1k':>10} {'x first':>8}"
    )
    for r in rows:
        cost = r["scheduler_cpu_ms_per_1k_reports"]
        growth = cost / base if cost and base else float("nan")
        print(
            f"{r['trainers']:>8} {r['leases_per_s']:>9.0f} {r['reports_per_s']:>10.0f} "
            f"{r['report_calls_per_s']:>8.0f} {r['lease_p50_ms']:>8.1f}ms "
            f"{r['lease_p99_ms']:>5.1f}ms "
            f"{r['report_p50_ms']:>9.1f}ms {r['report_p99_ms']:>5.1f}ms {r['steps_per_s']:>8.2f} "
            f"{cost or float('nan'):>10.1f} {growth:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
