"""`swarm demo` (what `make demo` runs): an embedded MQTT broker and a scheduler, stage servers of
different speeds as separate processes, the example job submitted and trained with its progress
shown, a replica killed halfway to show training carry on, the metrics endpoints listed, and
everything shut down with no process left behind. `--chaos` keeps killing replicas and starting
fresh peers that join the running job."""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from pathlib import Path

from tqdm import tqdm

from client.commands import watch
from client.sdk import SchedulerClient
from swarm.errors import SwarmError
from swarm.job.config import load_job
from swarm.job.states import job_state_name as state_name
from swarm.job.states import peer_state_name
from swarm.local.procs import LocalSwarm, start_local_swarm
from swarm.ops.faults import ANY_REPLICA, Fault, FaultPlan, Point
from swarm.proto import scheduler_pb2
from swarm.proto.control_pb2 import PEER_STATE_SERVING

__all__ = ["DEFAULT_THROTTLES", "Chaos", "run_demo"]

# Five peers of different speeds, as on a volunteer swarm: 1x to 3x slower than this machine's
# cores. One more peer than stages, so at least one stage has a pool of two replicas.
DEFAULT_THROTTLES = (1.0, 1.5, 2.0, 3.0, 1.0)
POLL_S = 0.2  # how often the demo looks at the job, to kill on time


def _show_endpoints(sw: LocalSwarm) -> None:
    s = sw.scheduler.ready
    print(
        f"  scheduler   {s['address']}  broker {s['broker']}  "
        f"metrics http://127.0.0.1:{s['metrics']}/metrics"
    )
    for p in sw.peers:
        r = p.ready
        print(
            f"  {r['peer']:<10}  {r['address']}  throttle {float(r['throttle']):.1f}x  "
            f"metrics http://127.0.0.1:{r['metrics']}/metrics"
        )


def _replicas(status: scheduler_pb2.JobStatus) -> str:
    """Each stage's replicas and their states, as status shows them: why none could be spared."""
    return "; ".join(
        f"stage {s.stage}: "
        + (", ".join(f"{r.peer} {peer_state_name(r.state)}" for r in s.replicas) or "none")
        for s in status.stages
    )


def _victim(status: scheduler_pb2.JobStatus, rng: random.Random) -> str | None:
    """A replica whose stage keeps another one: killing it shows training carry on. Only those
    that count (serving: their join succeeded) do: one still joining holds no state yet."""
    pools = [
        serving
        for s in status.stages
        if len(serving := [r for r in s.replicas if r.state == PEER_STATE_SERVING]) >= 2
    ]
    return rng.choice(rng.choice(pools)).peer if pools else None


class Chaos:
    """The demo's faults as a `FaultPlan`: halfway through the job, SIGKILL one replica whose
    stage keeps another; with `chaos`, another one 5 steps after each kill. None in the last 3
    steps. One fault is planned at a time."""

    def __init__(self, steps: int, chaos: bool, rng: random.Random) -> None:
        self.plan = FaultPlan([Fault(ANY_REPLICA, Point.IDLE, steps // 2)])
        self.chaos, self.rng = chaos, rng
        self.kills = 0
        # Why no replica was killed yet, for the demo to say at the end where none was.
        self.why_not = f"the job did not reach step {steps // 2}, where the first kill is due"

    def victim(self, status: scheduler_pb2.JobStatus) -> str | None:
        """The peer to kill now, if a fault is due and a stage can spare a replica."""
        for fault in self.plan.due(status.step):
            near_end = status.step >= status.steps - 3
            victim = None if near_end else _victim(status, self.rng)
            if victim is None:
                self.plan.add(fault)  # no spare replica (yet): due again at the next look
                if not near_end:
                    self.why_not = f"no stage had two serving replicas at step {status.step}: "
                    self.why_not += _replicas(status)
                continue
            if self.chaos:
                self.plan.add(Fault(ANY_REPLICA, Point.IDLE, status.step + 5))
            return victim
        return None


async def _kill(
    sw: LocalSwarm, client: SchedulerClient, job: scheduler_pb2.JobStatus, plan: Chaos
) -> None:
    """Carry out the demo's `Chaos` while the job runs; with `plan.chaos`, start a fresh peer
    in place of each killed one (it joins the running job)."""
    while True:
        await asyncio.sleep(POLL_S)
        try:
            status = await client.get(job.job)
        except SwarmError as e:  # a busy scheduler: looked at again after the next pause
            plan.why_not = f"the job's status could not be read: {e}"
            continue
        if state_name(status.state) not in ("placing", "running", "stalled"):
            return
        victim = plan.victim(status)
        if victim is None:
            continue
        next(p for p in sw.peers if p.ready.get("peer") == victim).kill()
        plan.kills += 1
        tqdm.write(
            f"** step {status.step}: killed {victim} with SIGKILL; its stage keeps a "
            f"replica, its gradients are replayed there, and training carries on **"
        )
        if plan.chaos:
            peer = await asyncio.to_thread(sw.add_peer, plan.rng.choice([1.0, 1.5, 2.0]))
            tqdm.write(
                f"** a fresh peer {peer.ready['peer']} joins; it copies its stage's "
                f"state at a step boundary **"
            )


async def _train(sw: LocalSwarm, job_path: Path, chaos: bool) -> int:
    async with SchedulerClient(sw.address) as client:
        status = await client.submit(job_path)
        print(
            f"submitted {job_path.name} as job {status.job}; `swarm status {status.job} "
            f"--scheduler {sw.address}` shows it from another terminal",
            flush=True,
        )
        plan = Chaos(status.steps, chaos, random.Random(0))
        killer = asyncio.create_task(_kill(sw, client, status, plan))
        try:
            final = await watch(client, status)
        finally:
            killer.cancel()
        if killer.done() and not killer.cancelled() and killer.exception() is not None:
            print(f"** the demo stopped killing replicas: {killer.exception()!r} **")
        elif plan.kills == 0:
            print(f"** no replica was killed: {plan.why_not} **")
    if state_name(final.state) == "succeeded":
        print(
            f"job {final.job} succeeded: {final.step} steps, "
            f"loss {final.first_loss:.3f} -> {final.loss:.3f}"
        )
        await _sample(sw, final.job, job_path)
        return 0
    print(f"job {final.job} {state_name(final.state)}: {final.error or final.message}")
    return 1


async def _sample(sw: LocalSwarm, job_id: str, job_path: Path, prompt: str = "The Fox") -> None:
    """What the trained model says: the job's model downloaded from its replicas, then text
    sampled after `prompt` in this process (as `swarm generate` does with an export)."""
    import torch

    from swarm.model.generate import generate, text_codec
    from swarm.model.transformer import build_model

    job = load_job(job_path)
    if job.data.kind != "text":
        return  # token ids need the tokenizer they were made with: `swarm generate --tokenizer`
    with tempfile.TemporaryDirectory() as tmp:
        async with SchedulerClient(sw.address) as client:
            await client.export(job_id, Path(tmp) / "model.pt")
        state = torch.load(Path(tmp) / "model.pt", weights_only=True)
    model = build_model(job)
    model.load_state_dict(state)
    codec = text_codec()
    ids = generate(model.eval(), codec.encode(prompt), seq_len=job.model.seq_len, tokens=120)
    text = " ".join((prompt + codec.decode(ids)).split())  # on one line
    print(f"a sample of what it learned (swarm generate does this with an export):\n  {text}")


def run_demo(
    job_path: Path, throttles: tuple[float, ...] = DEFAULT_THROTTLES, chaos: bool = False
) -> int:
    job = load_job(job_path)  # a bad job file fails here, before anything starts
    log_dir = Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    threads = max(1, (os.cpu_count() or 1) // len(throttles))
    print(
        f"starting a scheduler (with an embedded MQTT broker) and {len(throttles)} stage "
        f"servers for a {job.training.stages}-stage model; logs in {log_dir}",
        flush=True,
    )
    # The scheduler reads job data only under its data root: the demo's is where its data lies.
    data_root = None if job.data.path is None else job.data.path.parent
    sw, _ = start_local_swarm(
        list(throttles), log_dir=log_dir, threads=threads, data_root=data_root
    )
    try:
        _show_endpoints(sw)
        return asyncio.run(_train(sw, job_path, chaos))
    finally:
        print("shutting down ...", flush=True)
        sw.stop()
        left = [p for p in [sw.scheduler, *sw.peers] if p.proc.poll() is None]
        print("all processes stopped" if not left else f"still running: {left}")
