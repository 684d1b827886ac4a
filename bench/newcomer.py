"""The newcomer path, timed (issue 51): the documented commands from an installed checkout to a
friend's stage server serving a job, with TLS and a token, on this machine (loopback stands for
the VPS and the friend's home), each its own process as a user would run it.

Two ways for the friend, alternated in one run:
- `invite` (now): `swarm invite friend` writes one file; the friend runs `swarm doctor --join`,
  then `swarm stage-server --join`.
- `by-hand` (before the invite): `swarm certs issue friend --peer friend`, the CA, certificate,
  key and token handed over as files, the friend's stage server given `--broker`, the TLS flags
  and `--token-file`.
Each prints its steps' seconds, the total from the scheduler's start to the friend's peer
serving, and the commands the friend types; the last line is the invite's total over the
by-hand one's (same run). `--fresh-clone` first clones this repository and times `make install`
in it (reported apart: it is the download, the same for both ways), then runs from the clone.

    .venv/bin/python bench/newcomer.py [--reps 1] [--fresh-clone]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.local.procs import SwarmProcess, start_process, stop_all  # noqa: E402

HOST = "127.0.0.1"
WAIT_S = 300.0


class Way:
    """One way through the steps, in a directory of its own: each step's seconds."""

    def __init__(self, work: Path, swarm: Path) -> None:
        self.work, self.swarm = work, swarm
        self.steps: list[tuple[str, float]] = []
        self.typed = 0  # commands the friend types
        self.procs: list[SwarmProcess] = []
        self.env = {"SWARM_CACHE_DIR": str(work / "cache"), "SWARM_DIAL_PRIVATE": "1"}

    def run(
        self, what: str, *args: str, friend: bool = False, env: dict[str, str] | None = None
    ) -> str:
        started = time.monotonic()
        done = subprocess.run(
            [str(self.swarm), *args],
            cwd=self.work,
            capture_output=True,
            text=True,
            env={**os.environ, **self.env, **(env or {})},
            timeout=WAIT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"swarm {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
            )
        self.steps.append((what, time.monotonic() - started))
        self.typed += friend
        return done.stdout

    def start(
        self, what: str, *args: str, friend: bool = False, env: dict[str, str] | None = None
    ) -> dict[str, str]:
        started = time.monotonic()
        name = what.replace(" ", "-")
        proc = start_process(
            list(args), log_dir=self.work, name=name, env={**self.env, **(env or {})}
        )
        self.procs.append(proc)
        ready = proc.wait_ready(WAIT_S)
        self.steps.append((what, time.monotonic() - started))
        self.typed += friend
        return ready

    def until(self, what: str, check: Callable[[], bool]) -> None:
        started = time.monotonic()
        while not check():
            if time.monotonic() - started > WAIT_S:
                raise RuntimeError(f"{what}: not within {WAIT_S:.0f} s")
            time.sleep(0.2)
        self.steps.append((what, time.monotonic() - started))

    def stop(self) -> None:
        stop_all(self.procs)

    @property
    def total(self) -> float:
        return sum(s for _, s in self.steps)


def _swarm_side(p: Way) -> tuple[str, str, dict[str, str]]:
    """The VPS's steps (docs/deployment.md sections 2 and 3): the CA, the scheduler's
    certificate, a token, the scheduler with its broker, a relay, a job. Returns the broker URL,
    the scheduler's address and the job id."""
    p.run("certs init", "certs", "init", "--dir", "certs")
    p.run("certs issue scheduler", "certs", "issue", "scheduler", "--host", HOST, "--dir", "certs")
    (p.work / "token").write_text(os.urandom(24).hex() + "\n")
    (p.work / "token").chmod(0o600)
    tls = {
        "SWARM_TLS_CA": str(p.work / "certs/ca.pem"),
        "SWARM_TLS_CERT": str(p.work / "certs/scheduler.pem"),
        "SWARM_TLS_KEY": str(p.work / "certs/scheduler.key"),
        "SWARM_TOKEN_FILE": str(p.work / "token"),
    }
    data = p.work / "data"
    (data / "data").mkdir(parents=True)
    (data / "data" / "corpus.txt").write_bytes((ROOT / "examples/data/corpus.txt").read_bytes())
    job = (ROOT / "examples/tiny.toml").read_text().replace("stages = 4", "stages = 1")
    (data / "tiny.toml").write_text(job.replace("steps = 150", "steps = 100000"))
    ready = p.start(
        "scheduler",
        *("scheduler", "--host", HOST, "--port", "0", "--broker-port", "0"),
        *("--store", str(p.work / "jobs.sqlite"), "--checkpoint-dir", str(p.work / "ckpt")),
        *("--data-root", str(data)),
        env=tls,
    )
    broker, address = ready["broker"], ready["address"]
    p.start("relay", "relay", "--broker", broker, "--host", HOST, "--port", "0", env=tls)
    job_id = p.run("submit", "submit", str(data / "tiny.toml"), "--scheduler", address, env=tls)
    return broker, address, {**tls, "JOB": job_id.split()[0]}


def _serving(p: Way, address: str, job_id: str, env: dict[str, str]) -> Callable[[], bool]:
    def check() -> bool:
        done = subprocess.run(
            [str(p.swarm), "status", job_id, "--json", "--scheduler", address],
            cwd=p.work,
            capture_output=True,
            text=True,
            env={**os.environ, **p.env, **env},
        )
        if done.returncode != 0:
            return False
        stages = json.loads(done.stdout).get("stages", [])
        return any(
            r.get("peer") == "friend" and r.get("state") == "PEER_STATE_SERVING"
            for s in stages
            for r in s.get("replicas", [])
        )

    return check


def invite(work: Path, swarm: Path) -> Way:
    p = Way(work, swarm)
    try:
        broker, address, env = _swarm_side(p)
        job_id = env.pop("JOB")
        p.run(
            "swarm invite",
            *("invite", "friend", "--ca-dir", "certs", "--broker", broker),
            *("--scheduler", address, "--token-file", "token", "--out", "friend.invite.json"),
        )
        p.run(
            "doctor --join",
            "doctor",
            "--join",
            "friend.invite.json",
            "--device",
            "cpu",
            friend=True,
        )
        p.start(
            "stage-server --join",
            "stage-server",
            "--join",
            str(work / "friend.invite.json"),
            "--device",
            "cpu",
            friend=True,
        )
        p.until("friend serving", _serving(p, address, job_id, env))
    finally:
        p.stop()
    return p


def by_hand(work: Path, swarm: Path) -> Way:
    p = Way(work, swarm)
    try:
        broker, address, env = _swarm_side(p)
        job_id = env.pop("JOB")
        p.run(
            "certs issue friend", "certs", "issue", "friend", "--peer", "friend", "--dir", "certs"
        )
        theirs = {
            "SWARM_TLS_CA": str(work / "certs/ca.pem"),
            "SWARM_TLS_CERT": str(work / "certs/friend.pem"),
            "SWARM_TLS_KEY": str(work / "certs/friend.key"),
            "SWARM_TOKEN_FILE": str(work / "token"),
        }
        p.typed += 4  # the exports (or flags) of the files handed over
        p.start(
            "stage-server by hand",
            *(
                "stage-server",
                "--broker",
                broker,
                "--peer",
                "friend",
                "--behind-nat",
                "--device",
                "cpu",
            ),
            friend=True,
            env=theirs,
        )
        p.until("friend serving", _serving(p, address, job_id, env))
    finally:
        p.stop()
    return p


def _install(clone: Path) -> float:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    started = time.monotonic()
    subprocess.run(["make", "install"], cwd=clone, check=True, capture_output=True)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1, help="runs of each way, alternated")
    parser.add_argument("--fresh-clone", action="store_true", help="clone and `make install` first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-newcomer-") as tmp:
        swarm = ROOT / ".venv" / "bin" / "swarm"
        if args.fresh_clone:
            clone = Path(tmp) / "clone"
            print(f"fresh clone, make install: {_install(clone):.1f} s (apart: the same for both)")
            swarm = clone / ".venv" / "bin" / "swarm"
        totals: dict[str, list[float]] = {"invite": [], "by-hand": []}
        for rep in range(args.reps):
            for name, way in (("invite", invite), ("by-hand", by_hand)):
                work = Path(tmp) / f"{name}-{rep}"
                work.mkdir()
                p = way(work, swarm)
                steps = ", ".join(f"{what} {s:.1f} s" for what, s in p.steps)
                typed = f"{p.typed} commands typed by the friend"
                print(f"{name}: {p.total:.1f} s to the friend serving ({typed}): {steps}")
                totals[name].append(p.total)
        a, b = (statistics.median(totals[k]) for k in ("invite", "by-hand"))
        ratio = f"invite/by-hand = {a / b:.2f} (median of {args.reps})"
        print(f"invite {a:.1f} s, by hand {b:.1f} s: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
