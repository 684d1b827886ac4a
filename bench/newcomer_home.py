"""The newcomer path at home, timed (issue 68): a public host and a friend's two machines behind
one NAT router, each in a network namespace of its own, as docs/deployment.md's guide runs it.

The public host (`hub`) runs the scheduler with TLS (its embedded broker `mqtts://`, its
trainer) and a relay holding the swarm's CA, made with `swarm certs`; `swarm invite alice` there.
The friend's machines sit on one LAN behind a NAT router (`swarm.local.nat`) and each run
`swarm stage-server --join alice.invite.json` (the second with `--peer gpu1.alice`), no other
flag. The job is the guide's `examples/llama-small.toml` in 2 stages (one a machine), on the
push data plane, its 300 steps (`--steps`).

Printed: each milestone's seconds from the scheduler's start (scheduler ready, relay ready,
invite written, job submitted, each machine ready, both serving, the job finished), or "never
within W s" with the lines of the machine's log that say why; and the bytes stage 1's machine
took from stage 0's LAN address against those it took from the relay (nftables counters in its
namespace). Exit 1 when a milestone is missed, or when the LAN carried no more than the relay:
what a newcomer is promised is both machines serving from one invite, talking directly.

`--tree PATH` runs another checkout's `swarm` (this interpreter, that tree's code: cwd and
PYTHONPATH), e.g. `git worktree add /tmp/b8f54b2 b8f54b2` to time the path before issue 68.
`--fresh-clone` clones this repository and times `make install` in it first (the download; the
same for any tree), then runs the clone's own interpreter. Needs root, `ip netns` and nftables.

    .venv/bin/python bench/newcomer_home.py [--steps 300] [--wait-s 480] [--tree PATH]
        [--fresh-clone]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.newcomer import _install  # noqa: E402
from swarm.local import netns  # noqa: E402
from tests.support import namespaces  # noqa: E402

PREFIX = "swnh-"
HUB = "10.89.4.10"
HOME = netns.Lan("gw", "10.89.4.2", "192.168.94.0/24", {"a": "192.168.94.10", "b": "192.168.94.11"})
PEERS = {"a": "alice", "b": "gpu1.alice"}  # one invite, two machines
SCHEDULER = f"{HUB}:7700"
RELAY_PORT = 7100
WHY = re.compile(r"ERROR|WARNING|refused|does not name|Traceback")


class Run:
    """One run of the path: the namespaces, each process started, each milestone's second."""

    def __init__(self, lab: netns.Network, work: Path, tree: Path, python: str, wait_s: float):
        self.lab, self.work, self.tree, self.python = lab, work, tree, python
        self.started = time.monotonic()
        self.deadline = self.started + wait_s
        self.wait_s = wait_s
        self.procs: dict[str, netns.Proc] = {}
        self.milestones: dict[str, float | None] = {}

    def env(self, cache: str, **more: str) -> dict[str, str]:
        env = namespaces.host_env(self.work, cache, **more)
        return env | {"PYTHONPATH": str(self.tree)}

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "swarm.cli", "--log-level", "INFO", *args]

    def run_on(self, host: str, env: dict[str, str], *args: str) -> str:
        done = subprocess.run(
            ["ip", "netns", "exec", self.lab.ns[host], *self.argv(*args)],
            capture_output=True,
            text=True,
            env=env,
            cwd=self.tree,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"swarm {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
        return done.stdout

    def start(self, host: str, name: str, env: dict[str, str], *args: str) -> netns.Proc:
        proc = self.lab.start(host, name, self.argv(*args), self.work, env, self.tree)
        self.procs[name] = proc
        return proc

    def mark(self, milestone: str, reached: bool = True) -> None:
        self.milestones[milestone] = time.monotonic() - self.started if reached else None

    def why(self, name: str) -> str:
        lines = [line for line in self.procs[name].log().splitlines() if WHY.search(line)]
        return "\n".join(f"    {line[:240]}" for line in lines[-4:]) or "    (its log says nothing)"

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.kill()


def _job(data: Path, steps: int) -> Path:
    """The guide's job: llama-small, in 2 stages on the push plane, `steps` steps (the guide's
    checkpoints every 50 kept)."""
    (data / "data").mkdir(parents=True)
    (data / "data" / "corpus.txt").write_bytes((ROOT / "examples/data/corpus.txt").read_bytes())
    text = (ROOT / "examples/llama-small.toml").read_text()
    text = text.replace("stages = 4", "stages = 2").replace("steps = 300", f"steps = {steps}")
    text += '\n[runtime]\ndata_plane = "push"\n'
    (data / "llama-small.toml").write_text(text)
    return data / "llama-small.toml"


def _serving(status: dict[str, Any]) -> set[str]:
    """The peers serving a replica, by a job's status (`swarm status --json`)."""
    stages = status.get("stages", [])
    return {
        r["peer"]
        for s in stages
        for r in s.get("replicas", [])
        if r.get("state") == "PEER_STATE_SERVING"
    }


def walk(p: Run, steps: int) -> dict[str, int]:
    """The guide's steps, each milestone marked; the LAN's and the relay's bytes at stage 1."""
    certs = p.work / "certs"
    hub_env = p.env("hub", SWARM_TOKEN="newcomer-home-token")
    p.run_on("hub", hub_env, "certs", "init", "--dir", str(certs))
    p.run_on("hub", hub_env, "certs", "issue", "scheduler", "--host", HUB, "--dir", str(certs))
    tls = {
        "SWARM_TLS_CA": str(certs / "ca.pem"),
        "SWARM_TLS_CERT": str(certs / "scheduler.pem"),
        "SWARM_TLS_KEY": str(certs / "scheduler.key"),
    }
    hub_env |= tls
    data = p.work / "data"
    job = _job(data, steps)
    args = namespaces.scheduler_args(HUB, p.work, data)
    broker = p.start("hub", "scheduler", hub_env, *args).wait_ready(p.deadline)["broker"]
    p.mark("scheduler ready")
    relay = ("--host", "0.0.0.0", "--port", str(RELAY_PORT), "--announce-host", HUB)
    p.start("hub", "relay", hub_env, "relay", "--broker", broker, *relay).wait_ready(p.deadline)
    p.mark("relay ready")
    invite = p.work / "alice.invite.json"
    where = ("--broker", broker, "--scheduler", SCHEDULER, "--out", str(invite))
    p.run_on("hub", hub_env, "invite", "alice", "--ca-dir", str(certs), *where)
    p.mark("invite written")
    job_id = p.run_on("hub", hub_env, "submit", str(job), "--scheduler", SCHEDULER).split()[0]
    p.mark("job submitted")
    lan = dict(HOME.hosts)
    for host, neighbour in (("a", lan["b"]), ("b", lan["a"])):
        relayed = f"ip saddr {HUB} tcp sport {RELAY_PORT}"
        namespaces.tally(p.lab, host, {"lan": f"ip saddr {neighbour}", "relay": relayed})
    for host, peer in PEERS.items():  # the invite and nothing else, each its own cache
        more = ("--peer", peer) if peer != "alice" else ()
        p.start(host, host, p.env(host), "stage-server", "--join", str(invite), *more)
    for host in PEERS:
        try:
            p.procs[host].wait_ready(p.deadline)
            p.mark(f"machine {host} ready")
        except Exception:  # its log says why, printed below
            p.mark(f"machine {host} ready", reached=False)
    looker = namespaces.Looker(p.lab, "hub", SCHEDULER, hub_env)
    try:
        state, serving = "", set()
        while time.monotonic() < p.deadline and state not in (
            "JOB_STATE_SUCCEEDED",
            "JOB_STATE_FAILED",
        ):
            status = looker.look(job_id)
            state = str(status.get("state", ""))
            serving |= _serving(status)
            if "both serving" not in p.milestones and set(PEERS.values()) <= serving:
                p.mark("both serving")
            time.sleep(0.2)
        p.milestones.setdefault("both serving", None)
        p.mark("job finished", reached=state == "JOB_STATE_SUCCEEDED")
    finally:
        looker.close()
    counted = {host: namespaces.tallied(p.lab, host) for host in PEERS}
    placed = {
        host: int(m[1])
        for host in PEERS
        if (m := re.search(r"serving stage (\d+)", p.procs[host].log()))
    }
    last = next((h for h, stage in placed.items() if stage == 1), "b")
    return counted[last]


def score(milestones: dict[str, float | None], tally: dict[str, int]) -> list[str]:
    """What the path failed of its promise (empty: it kept it): each milestone missed, and the
    hops between the two machines not carried by their LAN (no more bytes from the neighbour
    than from the relay)."""
    failed = [f"{milestone}: never" for milestone, second in milestones.items() if second is None]
    if tally.get("lan", 0) <= tally.get("relay", 0):
        failed.append("the hops between the machines went through the relay, not their LAN")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="the job's steps (the guide's)")
    parser.add_argument("--wait-s", type=float, default=480.0, help="the whole path's bound")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose swarm runs")
    parser.add_argument("--fresh-clone", action="store_true", help="clone and `make install` first")
    args = parser.parse_args()
    problem = netns.available(routers=True)
    if problem:
        print(f"cannot run: {problem}")
        return 2
    tree, python = args.tree.resolve(), sys.executable
    with tempfile.TemporaryDirectory(prefix="swarm-newcomer-home-") as tmp:
        if args.fresh_clone:
            tree = Path(tmp) / "clone"
            print(f"fresh clone, make install: {_install(tree):.1f} s")
            python = str(tree / ".venv" / "bin" / "python")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
        ).stdout.strip()
        work = Path(tmp) / "work"
        work.mkdir()
        netns.remove_leftovers(PREFIX, lambda pid: Path(f"/proc/{pid}").exists())
        lab = netns.Network(PREFIX, {"hub": HUB}, [HOME])
        lab.create()
        run = Run(lab, work, tree, python, args.wait_s)
        try:
            tally = walk(run, args.steps)
        finally:
            run.stop()
            lab.destroy()
        failed = score(run.milestones, tally)
        print(f"the newcomer path at home, {commit or tree}, {args.steps} steps:")
        for milestone, second in run.milestones.items():
            took = f"{second:6.1f} s" if second is not None else f"never within {args.wait_s:.0f} s"
            print(f"  {milestone:<20} {took}")
        if failed:
            for host in PEERS:
                print(f"  {host} ({PEERS[host]}) said:\n{run.why(host)}")
        lan, relay = tally.get("lan", 0), tally.get("relay", 0)
        print(f"  stage 1's machine took {lan:,} bytes over the LAN, {relay:,} from the relay")
        print("FAIL: " + ", ".join(failed) if failed else "PASS")
        print(
            "RESULT " + json.dumps({"commit": commit, "milestones": run.milestones, "bytes": tally})
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
