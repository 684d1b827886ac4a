"""NAT: samples/s of a scheduled swarm of 4 stages x 2 replicas whose hosts are network namespaces,
each host's link shaped to `--rate`, with half of its stage servers behind home routers (each
its own: masquerade, every inbound connection dropped: `swarm.local.nat`), against the same swarm
with every peer public, in the same run; and each run's final parameters against `swarm local`
(float64).

    sudo .venv/bin/python bench/nat.py [--rate 100mbit] [--hub-rate 1gbit] [--steps 10]
        [--workload d256|tiny] [--natted 4] [--layout pinned|free] [--only ROW] [--reps 2]
        [--json] [--keep-logs] [--one-router]

Hosts. `hub` runs the scheduler (its embedded broker; no embedded trainer) and, in the NAT run, a
relay (`swarm relay`), its link shaped to `--hub-rate`; `trainer` runs one `swarm trainer`; each
stage server a host of its own. The public run's are `p0`..`p7`; the NAT run's `--natted` N of them
(default 4, half) are `n0`..`n<N-1>`, each `n<i>` on LAN 192.168.(90+i).0/24 behind router `r<i>`,
the rest `p0`..`p<7-N>`. A NAT'd server announces its LAN address, as at home: the scheduler's
dial-back finds it unreachable, it attaches to the relay, and every call to it goes through the
relay.

One router (`--one-router`, issue 51 item 7): the NAT'd servers share one home router instead
(LAN 192.168.90.0/24 behind `r0`, whose public leg, the home's one internet link that all its
machines share, is shaped to `--rate` each way like a host's), and the two runs are both NAT
runs: `lan`, as shipped (a NAT'd server calls a NAT'd neighbour at its LAN address once it
answered there as itself: `swarm.rpc.lan`), against `relay-only` (every stage server
`--relay-only`: every call to a NAT'd server through the relay, as before). The report's ratio
is lan over relay-only (target >= 1); a run that took the other path (its servers' logs) fails.

Layout. The issue asks for one whole stage served by NAT'd replicas only, which placement, left
free, never makes: it counts a relayed replica at a share of its speed
(`swarm.policy.placement.path_speeds`) and so pairs each NAT'd replica with a public one. So by
default (`--layout pinned`) the bench pins each server to a stage, production placement
unchanged: each server's throughput cache (`SWARM_CACHE_DIR`, one per server) holds the figure
the bench measured for its stage and 0 for every other ("cannot serve it"), so placement has
one choice. The slots are filled NAT'd first in the order stage 0's replicas, then every other
stage's first replica, then their second ones: N=4 gives stage 0 two NAT'd replicas, stages 1
and 2 one each, stage 3 none; N=6, stages 0 and 1 NAT'd only. The public run pins its servers to
the same slots, so the two runs differ only in who is behind NAT. `--layout free` leaves
placement to the scheduler (each server's figures all measured). Either way the report gives
each stage's replicas as `swarm status` showed them, and the stages served by NAT'd replicas
only; a pinned run whose placement is not its pin fails.

The links are shaped as bench/wan.py shapes them (tbf each way; the routers' uplinks unshaped:
each home router serves one host).

Rows (`LAYOUTS`; a new one is one entry): `public` (every server public, the baseline) and `nat`
(the NAT'd servers reached through the relay), or with `--one-router` `relay-only` (the
baseline) and `lan`. Runs alternate, `--reps` of each: public, nat, nat, public, ... (each rep
the last reversed), so that the machine's drift falls on both rows alike. Each on fresh
processes and a fresh job store: the job (bench/wan.py's workload, float64, 1 warm-up step +
`--steps`) is submitted, the trainer started; samples/s is the wall time from the end of the
warm-up step to the end of the last, as seen (polled) in the trainer's `--log`. The job is
trained to its end, exported and compared with `swarm local`'s parameters. Target: the nat
row's median at >= 0.8x the public row's (issue 42), the lan row's at >= 1x relay-only's:
PASS or FAIL.

Checked, since a ratio means nothing without them (a run failing one says FAILED and why, and
the bench exits 1): max |diff| against `swarm local` <= 1e-9 (float64, only the order of
additions differs); a pinned run placed as pinned; from `swarm status` during the run, each
NAT'd replica of a NAT'd row `relayed` through a relay and each public one `direct`; and, from
the stage servers' logs, a `lan` run's servers calling NAT'd neighbours at their LAN address, a
`relay-only` one's never.

Needs root, `ip`, `tc` and `nft`; namespaces `swnat-<pid>-*`, leftovers of a run that died removed
first, everything removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import wan  # noqa: E402  (puts the repository root on sys.path too)

from swarm.local import netns  # noqa: E402
from swarm.local.netns import Lan, Network, Proc  # noqa: E402

PREFIX = "swnat-"
SUBNET = "10.84.0"
HUB, TRAINER = "hub", "trainer"
REPLICAS = 2
SERVERS = wan.STAGES * REPLICAS
PUBLIC = [f"p{i}" for i in range(SERVERS)]
SCHEDULER_PORT, BROKER_PORT, RELAY_PORT, PORT = 7700, 1883, 7100, 7000
TOKEN = "bench-nat-token"
READY_TIMEOUT_S = 300.0


def addresses() -> dict[str, str]:
    hosts = [HUB, TRAINER, *PUBLIC]
    return {h: f"{SUBNET}.{10 + i}" for i, h in enumerate(hosts)}


def natted_hosts(count: int) -> list[str]:
    return [f"n{i}" for i in range(count)]


def lans(natted: list[str], one_router: bool = False) -> list[Lan]:
    """A home router of its own per NAT'd host, or (`one_router`) one for all of them."""
    if one_router:
        hosts = {h: f"192.168.90.{10 + i}" for i, h in enumerate(natted)}
        return [Lan("r0", f"{SUBNET}.100", "192.168.90.0/24", hosts)] if natted else []
    return [
        Lan(f"r{i}", f"{SUBNET}.{100 + i}", f"192.168.{90 + i}.0/24", {h: f"192.168.{90 + i}.10"})
        for i, h in enumerate(natted)
    ]


LAN_DIRECT = "its LAN address answers as the peer"  # swarm.rpc.lan's line, once per path


@dataclass(frozen=True)
class Layout:
    """Who is where in one row of the bench, and what its run must show to count. `natted`:
    its first `--natted` stage servers are the NAT'd hosts (else every server is public);
    `relayed`: those are reached through the hub's relay (`swarm status` must say so);
    `relay_only`: its stage servers run `--relay-only`; `lan`: whether its servers must have
    called NAT'd neighbours at their LAN address (True), must not have (False), or either
    (None); `one_router`: a row of `--one-router` (all NAT'd servers behind one router);
    `baseline`: the row the others of its mode are measured against; `target`: the least
    ratio to the baseline that passes. A new row is one more entry of `LAYOUTS`."""

    label: str
    natted: bool
    relayed: bool
    relay_only: bool = False
    lan: bool | None = None
    one_router: bool = False
    baseline: bool = False
    target: float = 0.0


LAYOUTS = {
    row.label: row
    for row in (
        Layout("public", natted=False, relayed=False, baseline=True),
        Layout("nat", natted=True, relayed=True, target=0.8),  # issue 42: >= 0.8x public
        # one router: both NAT runs, relayed only against LAN-direct (issue 51, item 7)
        Layout(
            "relay-only", True, True, relay_only=True, lan=False, one_router=True, baseline=True
        ),
        Layout("lan", natted=True, relayed=True, lan=True, one_router=True, target=1.0),
    )
}
MAX_DIFF = 1e-9  # float64 against `swarm local`: only the order of additions differs


def rows(one_router: bool) -> list[str]:
    """The layouts of a mode, its baseline first."""
    mine = [row for row in LAYOUTS.values() if row.one_router == one_router]
    return [row.label for row in sorted(mine, key=lambda row: not row.baseline)]


def order(labels: list[str], reps: int) -> list[str]:
    """The runs in turn, the rows alternating so that the machine's drift falls on all alike:
    public, nat, nat, public, ... (each rep the previous one reversed)."""
    runs: list[str] = []
    for rep in range(reps):
        runs += labels if rep % 2 == 0 else labels[::-1]
    return runs


def slots() -> list[int]:
    """The stage of each slot, in the order NAT'd servers fill them: stage 0's replicas (the
    stage served by NAT'd replicas only), then every other stage's first replica, then their
    second ones (so the next NAT'd servers share stages with public ones)."""
    rest = [k for _ in range(REPLICAS) for k in range(1, wan.STAGES)]
    return [0] * REPLICAS + rest


def run_hosts(label: str, natted: list[str]) -> list[str]:
    """The stage servers of a run, in slot order: a NAT'd layout's NAT'd ones first."""
    if not LAYOUTS[label].natted:
        return list(PUBLIC)
    return natted + PUBLIC[: SERVERS - len(natted)]


def pinned_stages(label: str, natted: list[str]) -> dict[str, int]:
    """Each stage server of a run -> the stage it is pinned to (`slots`)."""
    return dict(zip(run_hosts(label, natted), slots(), strict=True))


def write_pins(work: Path, job: Path, label: str, pins: dict[str, int]) -> None:
    """Each pinned server's own throughput cache (`cache-<run>-<host>`, `label` the run's
    name): the figure measured here for its stage, 0 for every other stage, so it announces it
    can serve that one only."""
    import torch

    from stage_server.replica.speed import _key, measure_job
    from swarm.job.config import load_job

    config, cpu = load_job(job), torch.device("cpu")
    torch.set_num_threads(1)  # as the servers compute (`--threads 1`)
    os.environ["SWARM_CACHE_DIR"] = str(work / "cache")  # measured once for both runs
    figures = measure_job(config, cpu)
    for host, stage in pins.items():
        cache = {_key(config, k, cpu): figures[k] if k == stage else 0.0 for k in figures}
        path = work / f"cache-{label}-{host}" / "throughput.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache))


def env(work: Path) -> dict[str, str]:
    return wan.child_env(work) | {"SWARM_TOKEN": TOKEN}


def client(net: Network, work: Path, *args: str) -> str:
    """A `swarm` client command from the trainer's host; its stdout."""
    argv = ["ip", "netns", "exec", net.ns[TRAINER], *wan.swarm_cmd(*args)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env(work), cwd=wan.ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"swarm {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# The step follower (`nat.py --follow BROKER_HOST BROKER_PORT JOB OUT`, run in the trainer's
# namespace): a remote trainer writes no step log, so each StepCommitted the scheduler publishes
# is written to OUT as one JSON line with the time it was seen.


async def _follow(host: str, port: int, job: str, out: Path) -> None:
    import aiomqtt

    from swarm.bus.topics import Topics
    from swarm.proto import control_pb2

    async with aiomqtt.Client(host, port, username="bench", password=TOKEN) as bus:
        await bus.subscribe(Topics().steps(job), qos=1)
        print("swarm nat-follower ready: job=" + job, flush=True)
        with out.open("a") as f:
            last = -1
            async for message in bus.messages:
                payload = bytes(message.payload)  # type: ignore[arg-type]
                step = control_pb2.StepCommitted.FromString(payload)
                # a retained topic cleared, a step seen again, or the job's start (no samples)
                if not payload or step.step <= last or step.samples == 0:
                    continue
                last = step.step
                line = {"step": step.step, "samples": step.samples, "seen": time.monotonic()}
                f.write(json.dumps(line) + "\n")
                f.flush()


@dataclass
class Run:
    label: str  # its layout
    name: str  # the run's own (its files'): the layout's label and its rep
    samples_per_s: float
    seconds: float
    steps: int
    placement: list[list[dict[str, Any]]]  # per stage, its replicas: peer, natted, reachability
    natted_only_stages: list[int]
    max_abs_diff: float  # against `swarm local`
    pinned: list[list[str]] | None  # per stage, the servers pinned to it (`--layout pinned`)
    lan_paths: int  # relayed peers its stage servers called at their LAN address (their logs)


def run_once(
    net: Network,
    job: Path,
    work: Path,
    label: str,
    name: str,
    natted: list[str],
    args: argparse.Namespace,
) -> Run:
    hub = net.addresses[HUB]
    scheduler = f"{hub}:{SCHEDULER_PORT}"
    at = ("--json", "--scheduler", scheduler)
    broker = f"mqtt://{hub}:{BROKER_PORT}"
    procs: list[Proc] = []

    pins = pinned_stages(label, natted) if args.layout == "pinned" else None
    if pins:
        write_pins(work, job, name, pins)

    def start(host: str, role: str, *argv: str) -> Proc:
        own = env(work)
        if pins and host in pins:
            own["SWARM_CACHE_DIR"] = str(work / f"cache-{name}-{host}")
        proc = net.start(host, f"{name}-{role}", wan.swarm_cmd(*argv), work, own, wan.ROOT)
        procs.append(proc)
        return proc

    try:
        start(
            HUB,
            "scheduler",
            *("scheduler", "--host", "0.0.0.0", "--announce-host", hub, "--no-embedded-trainer"),
            *("--port", str(SCHEDULER_PORT), "--broker-port", str(BROKER_PORT)),
            *("--store", str(work / f"{name}.sqlite"), "--data-root", str(work / "data")),
            *("--checkpoint-dir", str(work / f"{name}-ckpt"), "--min-replicas", str(REPLICAS)),
            "--dial-private",  # the namespaces' documentation and private ranges
        ).wait_ready(time.monotonic() + READY_TIMEOUT_S)
        if LAYOUTS[label].relayed:
            relay = ("--host", "0.0.0.0", "--port", str(RELAY_PORT), "--announce-host", hub)
            start(HUB, "relay", "relay", "--broker", broker, *relay)
        for host in run_hosts(label, natted):
            start(
                host,
                host,
                *("stage-server", "--broker", broker, "--host", "0.0.0.0", "--port", str(PORT)),
                *("--announce-host", net.addresses[host], "--peer", host, "--threads", "1"),
                *(["--relay-only"] if LAYOUTS[label].relay_only else []),
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in procs[1:]:  # the relay, then the stage servers
            proc.wait_ready(deadline)
        job_id = client(net, work, "submit", str(job), "--scheduler", scheduler).split()[0]
        log = work / f"{name}-steps.jsonl"
        follow = [sys.executable, str(Path(__file__).resolve()), "--follow", hub]
        follow += [str(BROKER_PORT), job_id, str(log)]
        follower = net.start(TRAINER, f"{name}-follower", follow, work, env(work), wan.ROOT)
        procs.append(follower)
        follower.wait_ready(time.monotonic() + 60)
        trainer = ("--scheduler", scheduler, "--job", job_id, "--threads", "1")
        start(TRAINER, "trainer", "trainer", *trainer)
        deadline = time.monotonic() + args.timeout
        total = args.steps + 1
        status: dict[str, Any] = {}
        gone: dict[str, float] = {}  # process -> when it was first seen exited
        polled = 0.0

        def placed() -> dict[str, Any]:
            """The job's status if it shows its whole placement (every stage served: a poll
            while the scheduler is still placing shows some stages empty), else the last one
            that did."""
            now = json.loads(client(net, work, "status", job_id, *at))
            stages = now.get("stages", [])
            return now if stages and all(s.get("replicas") for s in stages) else status

        while wan.count_lines(log) < total:
            if time.monotonic() > polled + 2:  # its placement, and who was reached how
                polled, status = time.monotonic(), placed()
            # the trainer exits once the job has no more steps (its last ones may reach the
            # follower a moment later); any other exit is a failure
            for proc in procs:
                if proc.popen.poll() is not None:
                    gone.setdefault(proc.name, time.monotonic())
                    if proc.popen.returncode or time.monotonic() - gone[proc.name] > 10:
                        raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {name} run did not do {total} steps in time")
            time.sleep(0.05)
        status = status or placed()  # a run shorter than a poll: its placement before its end
        wait_end(net, work, job_id, scheduler, deadline)
        out = work / f"{name}.pt"
        client(net, work, "export", job_id, "--out", str(out), *at[1:])
    finally:
        for proc in procs:
            proc.kill()
    lines = [json.loads(line) for line in log.read_text().splitlines()][:total]
    seconds = lines[-1]["seen"] - lines[0]["seen"]  # from the warm-up step's end to the last's
    placement = [
        [
            {
                "peer": r["peer"],
                "natted": r["peer"] in natted,
                "reachability": r.get("reachability", "").removeprefix("REACHABILITY_").lower(),
                "relay": r.get("relay", ""),
            }
            for r in stage.get("replicas", [])
        ]
        for stage in status.get("stages", [])
    ]
    return Run(
        label=label,
        name=name,
        samples_per_s=sum(line["samples"] for line in lines[1:]) / seconds,
        seconds=seconds,
        steps=len(lines) - 1,
        placement=placement,
        natted_only_stages=[k for k, reps in enumerate(placement) if reps and all_natted(reps)],
        max_abs_diff=max_abs_diff(out, job),
        pinned=[sorted(h for h, k in pins.items() if k == s) for s in range(wan.STAGES)]
        if pins
        else None,
        lan_paths=sum(p.log().count(LAN_DIRECT) for p in procs),
    )


def off_pin(run: Run) -> list[int]:
    """The stages whose replicas (as `swarm status` showed them) are not the servers pinned to
    them; [] for a run left free."""
    if run.pinned is None:
        return []
    shown = [sorted(r["peer"] for r in reps) for reps in run.placement]
    shown += [[]] * (len(run.pinned) - len(shown))
    return [k for k, (want, got) in enumerate(zip(run.pinned, shown, strict=True)) if want != got]


def problems(run: Run) -> list[str]:
    """What makes `run`'s figure no measure of its layout: parameters off `swarm local`'s, a
    placement other than the one pinned, NAT'd servers not reached through the relay (or
    public ones that were), or the LAN path taken where it must not be (or not where it must)."""
    found = []
    if not run.max_abs_diff <= MAX_DIFF:
        found.append(f"max|diff| vs swarm local {run.max_abs_diff:.3g} > {MAX_DIFF:g}")
    if off_pin(run):
        found.append(f"stages {off_pin(run)} not as pinned {run.pinned}")
    replicas = [r for reps in run.placement for r in reps]
    if not replicas:
        found.append("no placement seen in swarm status")
    layout = LAYOUTS[run.label]
    for r in replicas:
        if r["natted"] and layout.relayed and (r["reachability"] != "relayed" or not r["relay"]):
            found.append(f"NAT'd {r['peer']} was not relayed ({r['reachability'] or '?'})")
        if not r["natted"] and r["reachability"] != "direct":
            found.append(
                f"public {r['peer']} was not reached directly ({r['reachability'] or '?'})"
            )
    if layout.lan is not None and layout.lan != (run.lan_paths > 0):
        found.append(
            f"{run.lan_paths} relayed paths called at their LAN address (a {run.label} run)"
        )
    return found


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summary(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Per layout: its runs' samples/s, their median, and the median's ratio to its mode's
    baseline with its verdict against the layout's target (None without a baseline run)."""
    table: dict[str, dict[str, Any]] = {}
    for run in runs:
        table.setdefault(run.label, {"samples_per_s": []})["samples_per_s"].append(
            run.samples_per_s
        )
    for row in table.values():
        row["median"] = median(row["samples_per_s"])
    for label, row in table.items():
        layout = LAYOUTS[label]
        base = next(
            (
                table[b.label]
                for b in LAYOUTS.values()
                if b.baseline and b.one_router == layout.one_router and b.label in table
            ),
            None,
        )
        ratio = row["median"] / base["median"] if base and not layout.baseline else None
        row["ratio"] = ratio
        row["baseline"] = rows(layout.one_router)[0]
        row["target"] = layout.target
        row["verdict"] = None if ratio is None else ("PASS" if ratio >= layout.target else "FAIL")
    return table


def all_natted(replicas: list[dict[str, Any]]) -> bool:
    return all(r["natted"] for r in replicas)


def wait_end(net: Network, work: Path, job_id: str, scheduler: str, deadline: float) -> None:
    """Once the job succeeded (raises if it ended otherwise, or not in time)."""
    while time.monotonic() < deadline:
        status: dict[str, Any] = json.loads(
            client(net, work, "status", job_id, "--json", "--scheduler", scheduler)
        )
        if status["state"] == "JOB_STATE_SUCCEEDED":
            return
        if status["state"] in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
            raise RuntimeError(f"job {job_id} ended {status['state']}: {status.get('error')}")
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not end in time")


def max_abs_diff(exported: Path, job: Path) -> float:
    """The largest difference between the exported parameters and `swarm local`'s."""
    import torch

    from swarm.job.config import load_job
    from swarm.model.reference import train_local

    state = torch.load(exported, weights_only=True)
    want = train_local(load_job(job)).state_dict()
    if state.keys() != want.keys():
        return float("inf")
    return max((state[k] - v).abs().max().item() for k, v in want.items())


def print_report(r: dict[str, Any]) -> None:
    print(f"links {r['rate']} per host (hub {r['hub_rate']}); workload {r['workload']}, float64")
    where = "one router" if r.get("one_router") else "a router each"
    print(f"{r['natted']} of {SERVERS} stage servers behind NAT ({where}); layout {r['layout']}")
    print(f"runs in turn: {' '.join(run['name'] for run in r['runs'])}")
    print(f"{'run':<12} {'samples/s':>10} {'s/step':>8} {'max|diff| vs local':>19}  NAT'd-only")
    for run in r["runs"]:
        print(
            f"{run['name']:<12} {run['samples_per_s']:>10.2f} "
            f"{run['seconds'] / run['steps']:>8.2f} {run['max_abs_diff']:>19.3g}  "
            f"{run['natted_only_stages']}"
        )
        for k, reps in enumerate(run["placement"]):
            shown = ", ".join(f"{x['peer']} {x['reachability'] or '?'} {x['relay']}" for x in reps)
            print(f"    stage {k}: {shown}")
        if run["lan_paths"]:
            print(f"    {run['lan_paths']} relayed paths called at their LAN address")
        for problem in run["problems"]:
            print(f"    FAILED: {problem}")
    for label, row in r["layouts"].items():
        figures = " ".join(f"{x:.2f}" for x in row["samples_per_s"])
        line = f"{label:<12} median {row['median']:.2f} samples/s ({figures})"
        if row["ratio"] is not None:
            line += f"; {label}/{row['baseline']} {row['ratio']:.3f}: {row['verdict']}"
            line += f" (>= {row['target']})"
        print(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each host's link, each way")
    parser.add_argument("--hub-rate", default="1gbit", help="the hub's (scheduler, relay) link")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (plus 1 warm-up)")
    parser.add_argument("--workload", choices=sorted(wan.WORKLOADS), default="d256")
    parser.add_argument(
        "--natted",
        type=int,
        default=SERVERS // 2,
        help=f"stage servers behind NAT in the nat run (0..{SERVERS}; default: half)",
    )
    parser.add_argument(
        "--layout",
        choices=("pinned", "free"),
        default="pinned",
        help="pinned: NAT'd servers on stage 0 first (stage 0 NAT'd only), the same slots in "
        "both runs; free: the scheduler places them",
    )
    parser.add_argument("--only", choices=list(LAYOUTS), help="one layout alone (no ratio)")
    parser.add_argument(
        "--reps",
        type=int,
        default=2,
        help="runs of each layout, alternating (public, nat, nat, public, ...): one run of a "
        "row is no median",
    )
    parser.add_argument(
        "--one-router",
        action="store_true",
        help="the NAT'd servers behind one router; runs lan against relay-only",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--follow", nargs=4, help=argparse.SUPPRESS)  # HOST PORT JOB OUT
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps: give 1 or more")
    if args.only and LAYOUTS[args.only].one_router != args.one_router:
        given = "not a row of --one-router" if args.one_router else "a row of --one-router only"
        parser.error(f"--only {args.only}: {given}; give one of {', '.join(rows(args.one_router))}")
    if not 0 <= args.natted <= SERVERS:
        parser.error(f"--natted {args.natted}: give 0..{SERVERS}")
    return args


def _bench_alive(pid: int) -> bool:
    try:
        return b"nat.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def main() -> int:
    args = parse_args()
    if args.follow:
        host, port, job_id, out = args.follow
        asyncio.run(_follow(host, int(port), job_id, Path(out)))
        return 0
    problem = netns.available(routers=True)
    if problem:
        print(f"bench/nat.py: {problem}", file=sys.stderr)
        return 2
    rate, hub_rate = wan.parse_rate(args.rate), wan.parse_rate(args.hub_rate)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="swarm-nat-"))
    (work / "data").mkdir()
    toml = wan.job_toml(args.workload, args.steps + 1, "none", "push")
    job = work / "job.toml"
    job.write_text(toml.replace('dtype = "float32"', 'dtype = "float64"', 1))
    natted = natted_hosts(args.natted)
    net = Network(PREFIX, addresses(), lans(natted, args.one_router))
    runs: list[Run] = []
    status = 1
    try:
        netns.remove_leftovers(PREFIX, _bench_alive)
        net.create()
        net.shape(rate)
        net.shape_host(HUB, hub_rate, hub_rate)
        if args.one_router and natted:
            net.shape_host("r0", rate, rate)  # the home's uplink, shared by its machines
        labels = [args.only] if args.only else rows(args.one_router)
        for i, label in enumerate(order(labels, args.reps)):
            name = f"{label}{i}"
            print(f"{name} run ...", file=sys.stderr, flush=True)
            runs.append(run_once(net, job, work, label, name, natted, args))
        status = 0
    except KeyboardInterrupt:
        status = 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as e:
        print(f"bench/nat.py: {e}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        net.destroy()
        if status == 0 and not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs in {work}", file=sys.stderr)
    if status:
        return status
    result = {
        "rate": args.rate,
        "hub_rate": args.hub_rate,
        "workload": args.workload,
        "natted": args.natted,
        "layout": args.layout,
        "one_router": args.one_router,
        "reps": args.reps,
        "runs": [asdict(r) | {"off_pin": off_pin(r), "problems": problems(r)} for r in runs],
        "layouts": summary(runs),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    # A run with a problem measured something other than its layout: its ratio means nothing.
    failed = [f"{run['name']}: {p}" for run in result["runs"] for p in run["problems"]]
    for line in failed:
        print(f"bench/nat.py: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
