"""Averaging over uneven links (issue 43, item 7): pools whose members' uplinks differ, each member
a host of its own (a network namespace, `swarm.local.netns`, shaped per direction), a round with
equal parts against one with parts by water-filling, and the bound the LP gives, in one run.

    sudo .venv/bin/python bench/uneven.py [--params 8e6] [--reps 4] [--json]

(several minutes on two cores; each repetition adds one round of each kind to each scenario)

Scenarios: a pool of 4 with one member's uplink at 10 Mbit/s, and a pool of 8 with half of them
at 10 Mbit/s; every other uplink, and every downlink, at 100 Mbit/s. Each member is a pool
replica as a stage server has one (`PoolServicer` and `Averager` on a `grpc.aio` server, a
`ChannelPool`, its streams recording their bytes in a `LinkMeter`: `stage_server.peer.links`)
holding a seeded random float32 gradient of `--params` values, in a process of its own in its
namespace. After a warm-up, one untimed round with equal parts measures the members' upload rates
(their meters' after it), which give the water-filling weights (`swarm.policy.parts.water_fill`,
used as `RoundSettings(parts=Parts(weights))`). Then `--reps` repetitions in which a round of each
kind (equal parts, water-filled, with the aggregator below) takes its turn, the order reversed
every repetition, so that the machine's drift (+-30% over minutes here) lands on every kind alike.
Uploads, not the smaller of both: a member's download in a round overlaps the slowest member's
streams to it, so what it measures there is a lower bound held down by the slow senders (41-52
Mbit/s of a 100 Mbit/s downlink in a trial run), while its upload bursts are its own (9.8 of 10,
97-108 of 100 Mbit/s). A round's seconds are its slowest member's, median over rounds. Every
member's sum is checked against ((g0 + g1) + g2) + ... computed here in the same order, whatever
the parts.

The bound: full duplex and bandwidth-bound, a member owning w of the gradient's V bytes sends
(1 - w) V of contributions and (n - 1) w V of its part's sum, and receives as much: (1 + (n - 2)
w) V each way, at its uplink's and its downlink's rate. A round lasts as long as its slowest
member needs; the LP's optimum is that time at the water-filling weights ("bound, measured":
from the measured upload rates; "bound, shaped": from the rates tc was given, each member's
smaller). Equal parts' model time is shown too, as is each ratio: the issue's targets are
water-filled within 1.15 x of the bound and >= 1.3 x faster than equal parts for the pool of 4.

Then the same pool with one aggregator peer on a host of its own at 1 Gbit/s both ways: a member
in aggregator mode serving `PoolServicer` and `Averager` with no gradient (what
`stage_server.aggregator.main` serves), last in the group, `Parts(weights, contributors=n)`, the
parts `water_fill(rates, n)` from the members' measured uploads and the aggregator's shaped rate (it
has measured nothing before it owns a part; what it measured is printed beside). Its bound: a
contributor's bytes as above with m = n contributors, the aggregator's m w V each way.

Every member connects to every other before the warm-up, while the links are idle (see
`member`), and a failed round shows every failed member's log tail. `--params` below 8e6 leaves
the members' upload bursts under the link meter's 16 MiB floor (`stage_server.peer.links`'s
MIN_UP_BYTES): a fast member's contributions, 0.75 of the gradient, are one burst, and its sums
another, so no upload rate is measured and the run stops.

`--member JSON` runs one member (the benchmark starts them; not by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bulk import Child, reference_sha  # noqa: E402
from bench.bulk_child import command, gradient, options, say, wait_for  # noqa: E402
from swarm.local.netns import Network, remove_leftovers  # noqa: E402

PREFIX = "swu-"
SUBNET = "10.78.0"
PORT = 7100  # every member's (namespaces are separate)
MBIT = 1e6
SLOW_BITS, FAST_BITS = 10 * MBIT, 100 * MBIT
AGGREGATOR_BITS = 1000 * MBIT
POOL_JOB = "bench-uneven"
CHUNK_BYTES = 1 << 20
ROUND_TIMEOUT_S = 600.0
SCENARIOS = (("pool of 4, one slow uplink", 4, 1), ("pool of 8, half slow uplinks", 8, 4))


# --- a member, in its namespace -------------------------------------------------------------


async def member(args: dict[str, Any]) -> None:
    import grpc

    from stage_server.averaging.butterfly import RoundSettings, all_reduce
    from stage_server.averaging.channels import ChannelPool
    from stage_server.averaging.owner import Averager
    from stage_server.averaging.service import PoolServicer
    from stage_server.peer.links import LinkMeter
    from swarm.errors import NotFound
    from swarm.policy.parts import Parts
    from swarm.proto import pool_pb2_grpc

    def route(job: str, stage: int) -> None:
        if job != POOL_JOB or stage != 0:
            raise NotFound(f"job {job!r} stage {stage} is not served here")

    most = 4 * args["params"] + CHUNK_BYTES
    link = LinkMeter()
    server = grpc.aio.server(options=options())
    averager = Averager()
    servicer = PoolServicer(
        averager,
        route=route,
        chunk_bytes=CHUNK_BYTES,
        max_bytes=most,
        timeout_s=ROUND_TIMEOUT_S,
        link=link,
    )
    pool_pb2_grpc.add_PoolServiceServicer_to_server(servicer, server)
    address = f"{args['host']}:{PORT}"
    server.add_insecure_port(address)
    await server.start()
    channels = ChannelPool(options=options(), link=link)
    say(ready=address)
    group = (await wait_for("group"))[1].split(",")
    # Every connection made now, while the links are idle. Made lazily at the first round's
    # start instead, a member's connection to a slow-uplink member waits for that member's
    # answers (SYN-ACK, then HTTP/2 SETTINGS) behind its own saturated uplink: tbf drops what
    # would queue past 100 ms, the kernel backs off 1, 2, 4, 8 s per drop, and gRPC gives a
    # connection attempt 20 s ("timed out before receiving SETTINGS frame"); that member then
    # aborts the round, stops its server, and the others see GOAWAY ("RPC already finished").
    # An aggregator opens no calls (it answers those made to it): no channels of its own.
    if not args.get("aggregator"):
        await asyncio.gather(*(channels.channel(a).channel_ready() for a in group if a != address))
    say(prepared=True)
    flat = None if args.get("aggregator") else gradient(args["params"], args["seed"])
    try:
        while (cmd := await command())[0] in ("go", "rates"):
            if cmd[0] == "rates" or flat is None:  # an aggregator: what its streams measured
                link.settle(0.0)
                say(result={"rates": list(link.rates())})
                continue
            # go TAG WEIGHTS|- CONTRIBUTORS: 0 contributors, the group's members without the
            # aggregator (the last of `group`, when there is one); n, all of it, the last owning
            # parts without contributing (`Parts.contributors`: issue 43)
            weights = [float(w) for w in cmd[2].split(",")] if cmd[2] != "-" else []
            contributors = int(cmd[3])
            members = group if contributors else group[: args["members"]]
            settings = RoundSettings(
                group=members,
                index=members.index(address),
                round=cmd[1],
                job=POOL_JOB,
                stage=0,
                timeout_s=ROUND_TIMEOUT_S,
                chunk_bytes=CHUNK_BYTES,
                max_bytes=most,
                parts=Parts(weights, contributors),
            )
            started = asyncio.get_running_loop().time()
            total = await all_reduce(flat, settings, averager=averager, channels=channels)
            seconds = asyncio.get_running_loop().time() - started
            link.settle(0.0)  # as a commit does once its round is over
            digest = hashlib.sha256(total.numpy().data.cast("B")).hexdigest()
            say(result={"seconds": seconds, "sha256": digest, "rates": list(link.rates())})
    finally:
        await channels.close()
        await server.stop(None)


# --- the benchmark --------------------------------------------------------------------------


class NsChild(Child):
    """A member in `host`'s namespace, spoken to as `bench.bulk.Child` speaks to its own."""

    def __init__(self, net: Network, host: str, args: dict[str, Any], log_dir: Path) -> None:
        self.name, self.log_path = host, log_dir / f"{host}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, str(Path(__file__).resolve()), "--member", json.dumps(args)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", net.ns[host], *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=ROOT,
            )
        self._buffer = b""


def go_and_read(children: Sequence[Child], line: str) -> list[Any]:
    """Every member's result of the round `line` starts; if any failed, every failed member's
    log tail (the first to fail is usually not the one whose error ends the run)."""
    for c in children:
        c.send(line)
    results, failed = [], []
    for c in children:
        try:
            results.append(c.read("result"))
        except RuntimeError as e:
            failed.append(str(e))
    if failed:
        raise RuntimeError(f"{line!r}: {len(failed)} member(s) failed:\n" + "\n\n".join(failed))
    return results


def model_time(
    nbytes: float, rates: Sequence[float], weights: Sequence[float], contributors: int = 0
) -> float:
    """Seconds of a bandwidth-bound full-duplex round of `nbytes` with these parts: the slowest
    member's bytes at its rate, a contributor's (1 + (m - 2) w) V, an aggregator's m w V (it
    takes m contributions of its part and sends m sums back), m contributors (see the module's
    note)."""
    m = contributors or len(rates)
    return max(
        (1 + (m - 2) * w if i < m else m * w) * nbytes / r
        for i, (r, w) in enumerate(zip(rates, weights, strict=True))
    )


@dataclass
class Scenario:
    name: str
    members: int
    slow: int
    shaped_up: list[float]  # bytes/s, as tc was told
    shaped_down: list[float]
    equal_s: list[float]
    water_s: list[float]
    measured_up: list[float]
    measured_down: list[float]
    weights: list[float]
    aggregated_s: list[float]  # water-filled with the aggregator (index `members`)
    aggregated_weights: list[float]
    aggregator_rates: list[float]  # what its streams measured: up, down

    def row(self, nbytes: int) -> dict[str, Any]:
        from swarm.policy.parts import water_fill

        n = self.members
        equal_w = [1 / n] * n
        shaped = [min(u, d) for u, d in zip(self.shaped_up, self.shaped_down, strict=True)]
        shaped_w = water_fill(shaped, n)
        bound = model_time(nbytes, self.measured_up, self.weights)
        equal, water = statistics.median(self.equal_s), statistics.median(self.water_s)
        aggregated = statistics.median(self.aggregated_s)
        with_agg = [*self.measured_up, AGGREGATOR_BITS / 8]
        agg_bound = model_time(nbytes, with_agg, self.aggregated_weights, n)
        agg_shaped = [*shaped, AGGREGATOR_BITS / 8]
        return {
            "scenario": self.name,
            "equal_s": equal,
            "water_filled_s": water,
            "speed_up": equal / water,
            "bound_measured_s": bound,
            "water_over_bound": water / bound,
            "bound_shaped_s": model_time(nbytes, shaped, shaped_w),
            "equal_model_s": model_time(nbytes, shaped, equal_w),
            "weights": self.weights,
            "measured_up_mbit": [8 * r / MBIT for r in self.measured_up],
            "measured_down_mbit": [8 * r / MBIT for r in self.measured_down],
            "equal_rounds_s": self.equal_s,
            "water_filled_rounds_s": self.water_s,
            "aggregated_s": aggregated,
            "aggregated_speed_up": equal / aggregated,
            "aggregated_bound_s": agg_bound,
            "aggregated_over_bound": aggregated / agg_bound,
            "aggregated_bound_shaped_s": model_time(
                nbytes, agg_shaped, water_fill(agg_shaped, n), n
            ),
            "aggregated_weights": self.aggregated_weights,
            "aggregated_rounds_s": self.aggregated_s,
            "aggregator_measured_mbit": [8 * r / MBIT for r in self.aggregator_rates],
        }


def run_scenario(
    name: str, n: int, slow: int, params: int, reps: int, expected: str, work: Path
) -> Scenario:
    from swarm.policy.parts import water_fill

    hosts = [f"m{i}" for i in range(n)] + ["agg"]
    net = Network(PREFIX, {h: f"{SUBNET}.{11 + i}" for i, h in enumerate(hosts)})
    up_bits = [SLOW_BITS if i < slow else FAST_BITS for i in range(n)]
    children: list[Child] = []
    try:
        net.create()
        for host, bits in zip(hosts, up_bits, strict=False):
            net.shape_host(host, bits, FAST_BITS)  # helper "lab": upload, download
        net.shape_host("agg", AGGREGATOR_BITS, AGGREGATOR_BITS)
        for i, host in enumerate(hosts):
            args = {
                "params": params,
                "seed": i,
                "host": net.addresses[host],
                "members": n,
                "aggregator": host == "agg",
            }
            children.append(NsChild(net, host, args, work))
        group = [c.read("ready") for c in children]
        for c in children:
            c.send("group " + ",".join(group))
        for c in children:
            c.read("prepared")
        members, aggregator = children[:n], children[n]

        def one_round(tag: str, weights: Sequence[float] = (), contributors: int = 0) -> Any:
            shares = ",".join(f"{w:.17g}" for w in weights) or "-"
            last = go_and_read(members, f"go {tag} {shares} {contributors}")
            if {x["sha256"] for x in last} != {expected}:
                raise RuntimeError(f"{name}: round {tag}: the sums differ from the reference")
            return max(x["seconds"] for x in last), last

        go_and_read(members, "go warmup - 0")
        # One round with equal parts measures the members' links (not timed): the water-filling
        # weights come from it, before any timed round.
        _, after = one_round("measure")
        up = [x["rates"][0] for x in after]
        down = [x["rates"][1] for x in after]
        if min(up + down) <= 0:
            raise RuntimeError(f"{name}: a member measured no rate: up {up}, down {down}")
        weights = water_fill(up, n)  # uploads: see the module's note
        # The aggregator has taken no part yet: its rate is the one its link was shaped to (as
        # an operator's `--bandwidth` would announce it); what it measures is shown beside.
        aggregated_weights = water_fill([*up, AGGREGATOR_BITS / 8], n)
        kinds: dict[str, tuple[Sequence[float], int]] = {
            "equal": ((), 0),
            "water": (weights, 0),
            "aggregated": (aggregated_weights, n),
        }
        # The machine's speed drifts (+-30% over minutes on two shared cores): the kinds take
        # turns, in an order reversed every repetition, so that no kind always runs first or
        # last and a drift lands on all of them alike.
        timed: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(reps):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                seconds, _ = one_round(f"{kind}{r}", *kinds[kind])
                timed[kind].append(seconds)
        equal_s, water_s, aggregated_s = timed["equal"], timed["water"], timed["aggregated"]
        aggregator_rates = go_and_read([aggregator], "rates")[0]["rates"]
        return Scenario(
            name,
            n,
            slow,
            [b / 8 for b in up_bits],
            [FAST_BITS / 8] * n,
            equal_s,
            water_s,
            up,
            down,
            list(weights),
            aggregated_s,
            list(aggregated_weights),
            aggregator_rates,
        )
    finally:
        for c in children:
            c.close()
        net.destroy()


def print_rows(rows: list[dict[str, Any]], params: int) -> None:
    print(
        f"gradient: {params} float32 values ({4 * params / 1e6:.1f} MB); uplinks 10 or 100 "
        "Mbit/s, downlinks 100 Mbit/s, the aggregator's 1 Gbit/s both ways; seconds: the "
        "slowest member's, median"
    )
    head = (
        "scenario",
        "equal",
        "water-filled",
        "speed-up",
        "bound (meas.)",
        "water/bound",
        "bound (shaped)",
        "equal (model)",
    )
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['scenario']} | {r['equal_s']:.2f} s | {r['water_filled_s']:.2f} s | "
            f"{r['speed_up']:.2f} x | {r['bound_measured_s']:.2f} s | "
            f"{r['water_over_bound']:.2f} | {r['bound_shaped_s']:.2f} s | "
            f"{r['equal_model_s']:.2f} s"
        )
        print(
            f"{r['scenario']} + aggregator at 1 Gbit/s | - | {r['aggregated_s']:.2f} s | "
            f"{r['aggregated_speed_up']:.2f} x | {r['aggregated_bound_s']:.2f} s | "
            f"{r['aggregated_over_bound']:.2f} | {r['aggregated_bound_shaped_s']:.2f} s | -"
        )
    for r in rows:
        up = ", ".join(f"{m:.0f}" for m in r["measured_up_mbit"])
        down = ", ".join(f"{m:.0f}" for m in r["measured_down_mbit"])
        weights = ", ".join(f"{w:.3f}" for w in r["weights"])
        agg_w = ", ".join(f"{w:.3f}" for w in r["aggregated_weights"])
        agg = ", ".join(f"{m:.0f}" for m in r["aggregator_measured_mbit"])
        print(
            f"{r['scenario']}: measured Mbit/s up [{up}], down [{down}]; weights [{weights}]; "
            f"with the aggregator [{agg_w}], its measured up, down [{agg}]"
        )


def _alive(pid: int) -> bool:
    try:
        return b"uneven.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--params",
        type=float,
        default=8e6,
        help="gradient values (float32): 32 MB, so that each upload burst is far larger than "
        "what a sender's buffers hold (a few MB: `stage_server.peer.links`)",
    )
    p.add_argument(
        "--reps", type=int, default=4, help="rounds of each kind, taking turns, after a warm-up"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    p.add_argument("--member", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.member:
        asyncio.run(member(json.loads(args.member)))
        return 0
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("bench/uneven.py: needs root, ip and tc (network namespaces)", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    params = int(args.params)
    work = Path(tempfile.mkdtemp(prefix="swarm-uneven-"))
    removed = remove_leftovers(PREFIX, _alive)
    if removed:
        print(f"removed leftover namespaces: {', '.join(removed)}", file=sys.stderr)
    rows = []
    for name, n, slow in SCENARIOS:
        expected = reference_sha(params, n)
        scenario = run_scenario(name, n, slow, params, args.reps, expected, work)
        rows.append(scenario.row(4 * params))
    print_rows(rows, params)
    if args.json:
        print(json.dumps(rows, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
