"""The hostile inputs of the security reviews, each tried against real servers, brokers and
processes: prints, for each attack, whether today's code refuses it.

    .venv/bin/python bench/hostile_inputs.py [-k EXPR] [--slow]

Each attack is reproduced by the tests marked `@pytest.mark.attack("N1")` (raw HTTP/2 and MQTT
packets where the attack is below the client libraries, real Mosquitto where it is Mosquitto's);
a test passes when the attack is refused. This script runs those tests and prints one line per
attack: `refused` when every test of it passed, `NOT refused` (with the failing tests) when one
failed, `skipped` (with the skipped tests) when one was skipped, however (a skip proves nothing),
`no test` when nothing reproduces it yet, `slow: --slow` when only slow tests reproduce it and
--slow was not given. Exit status 0 only when every attack run is refused: an attack skipped or
without a test is not.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Issue 44's review ("let no one in, round two"); the ids are the issue's.
ATTACKS: dict[str, str] = {
    "N1": "half-sent calls hold every call slot; unbounded scheduler memory and sockets",
    "N2": "a peer takes the scheduler's (or another peer's) client id on Mosquitto",
    "N3": "retained messages and slow subscribers grow the broker without bound",
    "N4": "any token holder cancels, deletes or exports another user's job",
    "N5": "silent TLS connections exhaust the embedded broker's descriptors",
    "N6": "Reduce headers declaring ~1 GiB pin a replica's receive budget",
    "N7": "fake followers lock real joiners out of DownloadState",
    "N8": "a client id peer-X squatted by another user on the embedded broker",
    "N9": "a peer flipping its announcement forges job history and floods the log",
    "N10": "a NaN in a round's sums, outer step or final mean is applied to every replica",
    "N11": "a job too large for any peer is accepted and built; unfinished jobs uncapped",
    "N12": "a 1-byte-per-59-s state chunk keeps a checkpoint in progress forever",
    "N13": "empty Reduce calls pin memory after the caller hangs up",
    "N14": "connection churn, or unfinished requests from the scraper's host, starve /metrics",
    "N15": "a resuming coordinator trusts a member's unchecked round number",
    "N16": "one log line per refused connection or call, unrated",
    "N17": "a 63 MiB header parsed whole before the 64-tensor cap",
    "N18": "a scheduler on 0.0.0.0 without a token starts silently",
    "N19": "secrets accepted only on the command line",
    "N20": "the store and checkpoints are world-readable",
    "M9": "a token holder speaks for the scheduler in the commit protocol",
    "M9-hash": "init_from's hash cache keyed by path, size and mtime",
    "M9-load": "torch.load without weights_only in the demo",
    # Issue 42 (peers behind NAT): the relay and the reachability reports
    "R1": "a stranger attaches to a relay as a NAT'd peer",
    "R2": "a stranger opens a tunnel through a relay",
    "R3": "whoever carries a peer speaks for it",
    "R4": "one peer or caller exhausts a relay",
    "R5": "a relay opens tunnels to a peer's other ports, or Prometheus's credential to its RPCs",
    "42.1": "a peer reads another peer's reachability report",
    # Issue 43 (uneven links): aggregator peers
    "43.4": "an aggregator placed on a stage, in jobs not offered, or unbounded in memory",
    "43.4-sum": "an aggregator answering a finite wrong sum (caught by a checksum it cannot forge)",
    # Issue 54's review ("let no one in, round three")
    "H-rates": "announced link rates (1e12, NaN, 1.7e308 B/s) own a pool's parts or fail its job",
    "H-checks": "no checksum under a lossy codec; one seed for every stage; sparse forgeries; "
    "an owner who knows the seed",
    "H-relay": "a token holder attaches as a live NAT'd peer, or draws it to a relay of its own",
    "M-heads": "idle connections from one source hold every head slot of a relay",
    "M-fill": "made-up attachments and self-tunnels fill a relay's peers and descriptors",
    "M-scan": "the dial-back dials any host:port announced and returns the raw error",
    "L-dial": "peers naming silent hosts (one, or one each) hold the dial-back; a newcomer waits",
    "L-admin": "the admin token, root of every submitter token, is itself sent as a credential",
    "L-names": "under --tls-mutual a host certificate named as a submitter manages its jobs",
    "L-state": "a signed LoadState streams any state: the signature covers its call, not its state",
    "L-nonce": "a signed commit call replayed to a replica restarted within 5 minutes is taken",
    # Issue 55 (poison-proofing): the averaging side
    "55-owner": "a replica answers its averaging part's sums plus 1e4, applied by every replica",
    "55-norm": "a replica's finite wrong gradient (x1e4) applied by its pool (the norm bound)",
    "55-report": "a replica reports a wrong checksum of what it sent: honest owners left out",
    "55-forge": "a replica owner forges its part's sums within the norms: only left out",
    "55-frame": "a member lies about what it sent to frame an audited honest replica (banned)",
    "runner": "this script passes attacks without a test, or with skipped tests",
    # Issue 53 (a GPU does the work): the capacities replicas announce size trainers' windows
    "53-window": "replicas announcing 2^32-1 or the most a cache keeps size a trainer's window "
    "(its memory) at a whole step; one announcing 1 serialises its pipeline",
    # Issue 55 (poison-proof by re-execution): a replica that lies, in a float64 job
    "P-acts": "a replica answers finite wrong activations (every step, or one in 20)",
    "P-grads": "a replica answers finite wrong input gradients (every step, or one in 20)",
    "P-push-acts": "on the push plane, a replica sends finite wrong activations on",
    "P-push-grads": "on the push plane, a replica sends finite wrong input gradients back",
    "P-push-sent": "on the push plane, a replica commits to the honest outputs and sends others",
    "P-bent": "a replica answers honestly but contributes its gradient sums bent within the "
    "norm bound",
    "P-digest": "an auditor re-executes honestly but answers a wrong digest of the gradient of "
    "a contribution it audits",
    "P-push-bent": "on the push plane, a replica pushes honestly but contributes its gradient "
    "sums bent within the norm bound",
    "P-return": "a replica banned for lying is a member again, under its id, once the scheduler "
    "restarts",
    # Issue 64 item 8 (with issue 68 item 1): the names an invite certifies
    "64.8": "an invite issued for an authority's name (scheduler, admin, anything under "
    "peer.swarm) or naming a host; an invite's holder attaching as another's peer",
    "64.6-lan": "every caller (the scheduler's trainer included) probes the LAN address a "
    "relayed peer announced, with the swarm's token",
    "64.10": "a relay's announced id or address writes terminal escapes into `swarm doctor`",
    # Issue 64's review ("let no one in, round four")
    "64-lossy": "a hadamard3 owner answers a sign-flipped sum, 1e6 times it or a direction of its "
    "choosing (its own answer raised the encoding's allowance)",
    "64-speeds": "two peers announcing ~1e308 samples/s make placement divide by zero: the job "
    "FAILED",
    "64-depth": "a peer honest K steps that lies once rolls the job back K steps (all of it after "
    "a scheduler restart)",
    "64-devices": "an honest replica on another kind of device (TF32) is convicted by the "
    "contributions' audit",
    "64-seats": "two ids of one token holder in a stage frame its honest third replica with "
    "matching wrong re-executions",
    "64-dial": "the dial-back dials ipv4:/dns:/unix: targets (loopback, a Unix socket), and its "
    "report's timing tells closed ports from silent ones",
    "64-relay": "one source holds all of a NAT'd peer's relay tunnels; a home's /56 counts as 256 "
    "sources",
    "64-compose": "compose.yaml publishes the job API, the broker and /metrics, in clear text, on "
    "every interface (Docker's published ports bypass ufw)",
    "64-first-seen": "after a scheduler restart, a ban rolls back as if every member present at "
    "its start came at step 0 (who came when is not kept)",
    "64-entry": "a banned liar returns under fresh ids as often as it likes: twenty new ids join a "
    "stage at one step boundary",
    "64-credential": "an invite's holder banned under one peer id comes back under another id "
    "its certificate certifies (ids bound to certificates)",
    # Found since (docs/decisions.md, "A microbatch's activations serve their own caller")
    "cache-caller": "another token holder's Forward of a microbatch replaces the activations the "
    "trainer's Backward then differentiates: a wrong gradient, the honest replica banned",
    # docs/decisions.md, "A trainer speaks for its own leases"
    "trainer-word": "a token holder reports microbatches leased to others (voiding the replica it "
    "names), renews or gives back another trainer's leases, or renews one lease forever",
    # docs/decisions.md, "Only a round's members reduce"
    "round-members": "any token holder reduces as any member of any round: plants what an owner "
    "sums and reports, aborts a round naming its members, holds every open round on made-up ids",
    # docs/decisions.md, "Only a lease's holder accumulates"
    "lease-ticket": "a token holder accumulates into any replica's microbatch: a finite gradient "
    "replaces the honest one in the step, a NaN fails another submitter's job",
    # docs/decisions.md, "A lease ticket names its push's run"
    "lease-run": "a replica ahead of a stage on a push's route accumulates there first under a "
    "run of its own with that stage's ticket: the honest push is answered as a duplicate, and "
    "that replica's record of the honest run, not what it accumulated, frames it at its audit",
    # docs/decisions.md, "Under local rounds a late receipt voids its replica before the replay"
    "late-receipt-duplicate": "under local rounds a microbatch is given back with a stray "
    "receipt at a later stage's pool of one (a member ahead pushed there first); its replay "
    "lands there as a duplicate, is reported held, and the stray gradient stands in the round",
    # docs/decisions.md, "A late receipt is adopted only under its lease's run"
    "late-receipt-run": "a member ahead fails the honest hop, waits out the late-receipt check, "
    "then pushes the lessee's old run to a later stage with inputs of its own: the replay is "
    "answered there as a duplicate (or its receipt adopted at the next check) and the stray "
    "gradient stands",
    # docs/decisions.md, "A late receipt's push still in flight is waited for"
    "in-flight-forever": "a replica names a push of a microbatch given back as in flight and "
    "never ends it: the late-receipt check would wait for it, and the step with it, for good",
    # docs/decisions.md, "A push record is made once a run"
    "push-record": "a member of a push's path pushes the same run again with other inputs to an "
    "honest replica it went through: the record audited is not what that replica accumulated",
    # docs/decisions.md, "A NaN contribution is left out, not the job failed"
    "nan-contribution": "one replica of a pool contributes a NaN: every member's average is NaN "
    "and another submitter's job fails",
    # docs/decisions.md, "A NaN norm against its own reports is its own"
    "nan-norm": "one replica of a pool of two answers PREPARE with a NaN norm of its pool's "
    "average: no majority, and another submitter's job fails",
    # docs/decisions.md, "A NaN sent under finite words is one word against another"
    "nan-hidden": "one replica of a pool sends one owner a NaN and reports finite values of "
    "what it sent: the honest owners are left out one by one and the job fails",
    # docs/decisions.md, "A route's clients are made when a call needs one"
    "route-clients": "a lease holder's pushes each name 1,024 replicas of the next stage, "
    "others each time: its receiver makes a client for each on its event loop and keeps the "
    "replaced ones a minute (17 MB a push)",
    # docs/decisions.md, "A report of infinities fails nothing"
    "inf-report": "a lessee reports two digests, +inf and -inf: the coordinator's sum of them "
    "raises, and the job fails as a bug",
    # docs/decisions.md, "A step's audits are told only to the job's own trainers"
    "audit-seeds": "a replica's operator leases one microbatch of another submitter's job and "
    "learns whether its replica's contribution is audited, and the seed, before it sends it",
    # docs/decisions.md, "Three hostile inputs a review found (session 102)"
    "unreachable-crowd": "a token holder logs in under thousands of ids nobody can dial, free "
    "for any job: every job's message and status name them all (11 MB, 23 MB), stored, logged "
    "and sent on every change",
    "fetch-offset": "a token holder fetches a job's file from an offset past 2^62: the seek "
    "fails as a bug, an ERROR traceback for each call",
    "page-overflow": "a token holder lists jobs from page token 0x1p2000/0: the cursor's float "
    "overflows as a bug, an ERROR traceback for each call",
    "echo-whole": "a token holder's request field (a page token, a path) of megabytes is echoed "
    "whole in its refusal: a log line several times the request per call, and a status past "
    "the caller's metadata limit",
    # (route-inf also: a serving peer's announced speed of NaN, inf or -1 in every lease)
    "route-inf": "a token holder's push names a next-stage member of infinite throughput: the "
    "receiver's forward runs, then the push fails as a bug (INTERNAL, a traceback at ERROR)",
}


class _Outcomes:
    """A pytest plugin: the attack ids of each collected test, and each test's outcome."""

    def __init__(self, slow: bool) -> None:
        self.slow = slow  # run the slow tests too
        self.not_run: set[str] = set()  # attacks with a slow test left out
        self.ids: dict[str, list[str]] = {}
        self.failed: dict[str, list[str]] = defaultdict(list)
        self.passed: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, list[str]] = defaultdict(list)

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        kept = []
        for item in items:
            marks = [m.args[0] for m in item.iter_markers("attack")]
            if marks and not self.slow and item.get_closest_marker("slow"):
                self.not_run.update(marks)
            elif marks:
                self.ids[item.nodeid] = marks
                kept.append(item)
        items[:] = kept

    def pytest_runtest_logreport(self, report: Any) -> None:
        ids = self.ids.get(report.nodeid, [])
        if report.skipped:  # at setup (a skipif, a fixture's skip) or in the call
            for attack in ids:
                self.skipped[attack].append(report.nodeid)
        elif report.failed:
            for attack in ids:
                self.failed[attack].append(report.nodeid)
        elif report.when == "call" and report.passed:
            for attack in ids:
                self.passed[attack] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default=None, help="only the tests pytest's -k selects")
    parser.add_argument("--slow", action="store_true", help="the slow tests' attacks too")
    parser.add_argument("--tests", default=str(ROOT / "tests"), help="where the tests are")
    args = parser.parse_args(argv)
    outcomes = _Outcomes(args.slow)
    pytest_args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "attack",
    ]
    if args.k:
        pytest_args += ["-k", args.k]
    pytest.main([*pytest_args, args.tests], plugins=[outcomes])
    unrefused = 0
    print(f"\n{'attack':<8} {'result':<12} what")
    for attack, what in ATTACKS.items():
        if outcomes.failed.get(attack):
            result = "NOT refused"
        elif outcomes.skipped.get(attack):
            result = "skipped"
        elif outcomes.passed.get(attack):
            result = f"refused ({outcomes.passed[attack]})"
        elif attack in outcomes.not_run:
            result = "slow: --slow"  # its tests exist; not run this time, so not counted
        else:
            result = "no test"
        unrefused += not result.startswith(("refused", "slow"))
        print(f"{attack:<8} {result:<12} {what}")
        for nodeid in outcomes.failed.get(attack, []):
            print(f"{'':<8} failed: {nodeid}")
        for nodeid in outcomes.skipped.get(attack, []):
            print(f"{'':<8} skipped: {nodeid}")
    if unrefused:
        print(f"\n{unrefused} of {len(ATTACKS)} attacks not refused (failed, skipped, no test)")
    return 1 if unrefused else 0


if __name__ == "__main__":
    sys.exit(main())
