"""Time to loss: one score for every pool mode, as ProtocolNanoGPT scores pipeline training,

    T = steps to a target validation loss x steady-state step time,

with the steps measured with the links off and the step time over shaped links.

    sudo .venv/bin/python bench/time_to_loss.py [--workload d320|small]
        [--modes sync,delayed,local4,local16,...] [--compression int8_blockwise|none]
        [--links 20mbit,100mbit+50ms] [--max-steps 480] [--eval-every 16] [--target-step 240]
        [--outer 0.7:0.9] [--workers 2] [--cache bench/.time_to_loss_steps.json]
        [--agree 0.05] [--max-windows 6] [--uneven 10mbit/100mbit|none] [--steps-only] [--json]

Rows (`--modes`): `sync` (per-step synchronous averaging, the default pool), `delayed`
(`training.delayed_update`: each step's averaging overlaps the next step), `delayede` (the same
with `[pool] overlap = "eager"`: its eager rule, each replica's own fresh gradient share applied
at once and the others' one step late), `local<H>`
(`[pool] mode = "local"`, `sync_every = H`, outer lr and momentum from `--outer`), `local<H>e`
(the same with `overlap = "eager"`: a round's sum runs while the next round trains), each also
with `+int8` (`[compression] averaging = --compression`, `int8_blockwise` by default: the
pools' averaging traffic compressed). The default rows are sync, delayed, local4, local16 and,
unless `--compression none`, sync+int8, local4+int8, local16+int8. Every row runs the carry data
plane (`data_plane = "relay"`: local mode needs it), so rows differ only in the averaging rule
and its codec.

Steps to target (links off). Each rule trains in one process, the exact equivalent of the swarm
with 2 replicas per stage: `swarm.model.reference.train_local` for sync and delayed (step mode is
bitwise the single-process reference however many replicas), `swarm.model.local_steps.
train_replicas(job, replicas=2)` for local mode (its synthetic wiring spreads each step's
microbatches over the 2 replicas). Every rule evaluates the validation loss every `--eval-every`
steps (a multiple of every H: local mode evaluates only at a round's start) up to `--max-steps`.
The target is sync's validation loss at `--target-step`; a row's steps are the first evaluated
step whose loss is at or below it (none if never). The reference does not simulate an averaging
codec, so a `+int8` row shows its rule's uncompressed steps, marked "steps: uncompressed rule".
The trainings run `--workers` at a time, one torch thread each, and are cached in `--cache`
(keyed by the job's text), so a re-run measures the links without training again.

Step time (shaped links). For each link (`--links`, each "RATE[+DELAYms]": `20mbit`,
`100mbit+50ms`) and row, a fresh swarm of 2 stages x 2 replicas, each replica a host of its own
(`s<k>r<j>`) plus the trainer's, in network namespaces as bench/wan.py builds them (its
`Network`, tbf on both ends of every host's link, and its delaying relay in front of every stage
server). The step time is read off the trainer's `--log`: the time each line appears (polled),
which is right whatever the rule (with `delayed_update` a record's own `seconds` overlap the next
step's). After 2 warm-up steps the steps are cut into windows of max(4, H) (a window of a local
row holds one round's averaging); the steady step time is the mean of the first three consecutive
windows whose means lie within `--agree` of theirs, or, after `--max-windows` windows, of the
last three (the row then says "not steady"). Beside it: the trainer's blocked seconds per step
(no microbatch could be leased while a commit was under way), as a share of the step, and the
averaging bytes each replica sent per step over the same windows, read from every stage server's
`swarm_stage_averaging_bytes_sent_total` (scraped inside its namespace at each window's edges).

Uneven links (`--uneven SLOW/FAST`, default 10mbit/100mbit; `none` skips it; issue 43): sync on
one stage's pool of 3 replicas (hosts `u0`..`u2`; with 2 contributors no partition changes a
round's time), `u0`'s uplink at SLOW and every other link at FAST, under a scheduler (the
trainer's host) whose coordinator sizes each round's parts from the rates the peers announce:
two runs, parts equal (every member announces FAST) and water-filled (each announces its own:
`u0` owns nothing, a client). The partition changes no sum, so both take sync's steps to the
target; T = those steps x the steady step time (read off the scheduler's committed tokens),
beside the LP's bound for the step's vector (`swarm.policy.parts.round_time`: 1.33x at N = 3).
The slow uplink is shaped per direction with the lab harness's `Network.shape_host` where it has
it, else by tbf on `u0`'s own end.

Needs root, `ip`, `tc` and `curl` for the shaped part (`--steps-only` skips it). Namespaces are
`swttl-<pid>-<host>`; leftovers of a run that died are removed first, everything on exit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import wan  # noqa: E402  (puts the repository root on sys.path too)

ROOT = wan.ROOT

from swarm.errors import ConfigError  # noqa: E402
from swarm.job.config import parse_job  # noqa: E402
from swarm.job.rule import rule_of  # noqa: E402
from swarm.local.netns import Network, Proc, remove_leftovers  # noqa: E402

# Neither wan.py's ("swb-") nor tests/system/test_many_hosts.py's ("swt-"): each run removes the
# namespaces of its prefix whose maker it does not recognise, so a shared prefix kills the other's.
PREFIX = "swttl-"
STAGES = 2
REPLICAS = 2
METRICS_PORT = 9100
WARMUP_STEPS = 2
CORPUS = ROOT / "examples" / "data" / "corpus.txt"
SENT_METRIC = "swarm_stage_averaging_bytes_sent_total"
RECEIVED_METRIC = "swarm_stage_averaging_bytes_received_total"
SWARM_KEY = "\n# steps measured on a swarm, links off"  # a swarm curve's cache key: its job + this
# The goals: the best low-communication row's T against synchronous T, per link.
GOALS = {"20mbit": 0.5, "100mbit+50ms": 0.8}

WORKLOADS: dict[str, dict[str, int]] = {
    # ~2.55 M parameters (10.2 MB of float32) per stage against 32 samples of 32 tokens per step:
    # a 2-replica all-reduce moves ~10 MB each way per replica per step, ~4 s at 20 Mbit/s.
    "d320": dict(
        d_model=320, n_layers=4, n_heads=5, seq_len=32, microbatch_size=8, target_batch_size=32
    ),
    # a smoke run of the bench itself
    "small": dict(
        d_model=64, n_layers=2, n_heads=4, seq_len=32, microbatch_size=8, target_batch_size=32
    ),
}


# ---------------------------------------------------------------------------------------------
# Rows and jobs


@dataclass(frozen=True)
class Mode:
    name: str  # as the row is labelled: sync, delayed, local4, local16+int8 ...
    rule: str  # "sync", "delayed" or "local"
    h: int  # steps per round (1 unless local)
    compressed: bool  # averaging through --compression
    eager: bool = False  # local<H>e, delayede: pool.overlap = "eager" (a sum overlaps the next)

    @property
    def replicas(self) -> bool:
        """Whether the reference trains it as replicas (`train_replicas`): they differ."""
        return self.rule == "local" or self.eager

    @property
    def base(self) -> str:
        """The row of the same rule uncompressed (whose steps a compressed row shows)."""
        return self.name.split("+", 1)[0]

    @property
    def window(self) -> int:
        return max(4, self.h)


def short_codec(codec: str) -> str:
    return "int8" if codec == "int8_blockwise" else codec


def parse_mode(text: str, codec: str) -> Mode:
    match = re.fullmatch(r"(sync|delayed|local(\d+))(e?)(?:\+(\w+))?", text.strip())
    if match is None or (match.group(1) == "sync" and match.group(3)):
        raise ValueError(
            f"mode {text!r}: use sync, delayed, delayede, local<H> or local<H>e, optionally +int8"
        )
    rule = "local" if match.group(2) else match.group(1)
    h = int(match.group(2)) if match.group(2) else 1
    if rule == "local" and h < 1:
        raise ValueError(f"mode {text!r}: H must be >= 1")
    suffix = match.group(4)
    if suffix is not None:
        if codec == "none":
            raise ValueError(f"mode {text!r} needs --compression (it is none)")
        if suffix != short_codec(codec):
            raise ValueError(f"mode {text!r}: --compression {codec} is +{short_codec(codec)}")
        if rule == "delayed":
            raise ValueError(f"mode {text!r}: the compressed rows are sync and local")
    return Mode(text.strip(), rule, h, suffix is not None, match.group(3) == "e")


def default_modes(codec: str) -> list[str]:
    names = ["sync", "delayed", "local4", "local16"]
    if codec != "none":
        names += [f"{n}+{short_codec(codec)}" for n in ("sync", "local4", "local16")]
    return names


def job_text(
    workload: str,
    mode: Mode,
    steps: int,
    eval_every: int,
    outer: tuple[float, float],
    codec: str,
) -> str:
    """The row's job: the workload, the carry plane, the rule and (compressed) the codec. An
    eager row's job evaluates nothing (the swarm refuses it: its replicas share no parameters);
    its curve evaluates the replicas' mean every `eval_every` steps (`train_curve`), said in a
    comment so that the cache keeps it apart."""
    p = WORKLOADS[workload]
    cadence = eval_every
    if mode.eager:
        eval_every = 0
    text = f"""name = "ttl-{workload}"
[model]
kind = "gpt"
vocab_size = 256
d_model = {p["d_model"]}
n_layers = {p["n_layers"]}
n_heads = {p["n_heads"]}
seq_len = {p["seq_len"]}
[data]
kind = "text"
path = "{CORPUS}"
val_fraction = 0.1
[training]
stages = {STAGES}
microbatch_size = {p["microbatch_size"]}
target_batch_size = {p["target_batch_size"]}
steps = {steps}
dtype = "float32"
checkpoint_every = 0
eval_every = {eval_every}
eval_microbatches = 4
delayed_update = {"true" if mode.rule == "delayed" else "false"}
[optimizer]
kind = "adamw"
lr = 1e-3
[runtime]
data_plane = "relay"
"""
    if mode.rule == "local":
        text += f"""[pool]
mode = "local"
sync_every = {mode.h}
outer_lr = {outer[0]}
outer_momentum = {outer[1]}
"""
        if mode.eager:
            text += f"""overlap = "eager"
# bench: the reference evaluates the replicas' mean every {cadence} steps
"""
    elif mode.eager:  # delayede: delayed_update's eager rule
        text += f"""[pool]
overlap = "eager"
# bench: the reference evaluates the replicas' mean every {cadence} steps
"""
    if mode.compressed:
        text += f"""[compression]
averaging = "{codec}"
"""
    return text


# ---------------------------------------------------------------------------------------------
# Steps to target, links off


def train_curve(text: str, local: bool, eval_every: int) -> dict[str, Any]:
    """One rule's training in this process (one torch thread): its evaluations (step, loss).
    `eval_every`: the eager rows' cadence (their job evaluates nothing)."""
    import torch

    from swarm.model.local_steps import train_replicas
    from swarm.model.reference import train_local
    from swarm.ops.progress import StepRecord

    torch.set_num_threads(1)
    job = parse_job(text, ROOT, "ttl")
    evals: list[tuple[int, float]] = []
    losses: list[float] = []

    def on_step(record: StepRecord) -> None:
        if record.val_loss is not None:
            evals.append((record.step, record.val_loss))
        if not record.final_evaluation:
            losses.append(record.loss)

    began = time.perf_counter()
    if local:
        eager = rule_of(job).eager
        cadence = eval_every if eager else None
        train_replicas(job, replicas=REPLICAS, on_step=on_step, eval_every=cadence)
    else:
        train_local(job, on_step=on_step)
    return {
        "evals": evals,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "seconds": time.perf_counter() - began,
    }


def cache_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def curves(args: argparse.Namespace, modes: list[Mode]) -> dict[str, dict[str, Any]]:
    """Every uncompressed rule's evaluations (sync's always: it sets the target), by base name;
    from the cache where it holds them, else trained `--workers` at a time."""
    bases: dict[str, Mode] = {"sync": parse_mode("sync", args.compression)}
    for m in modes:
        bases.setdefault(m.base, parse_mode(m.base, args.compression))
    cache = load_cache(args.cache)
    texts = {
        name: job_text(args.workload, m, args.max_steps, args.eval_every, args.outer, "none")
        for name, m in bases.items()
    }
    out: dict[str, dict[str, Any]] = {}
    todo = []
    for name, text in texts.items():
        hit = cache.get(cache_key(text))
        if hit is not None and hit.get("text") == text:
            out[name] = hit
        else:
            todo.append(name)
    if todo:
        say(
            f"training {', '.join(todo)} to step {args.max_steps} (links off, {args.workers} at a "
            f"time; the cache {args.cache} keeps them) ..."
        )
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            futures = {
                pool.submit(train_curve, texts[n], bases[n].replicas, args.eval_every): n
                for n in todo
            }
            for fut in as_completed(futures):
                name = futures[fut]
                result = fut.result()
                result.update(mode=name, text=texts[name])
                out[name] = result
                store(args.cache, cache_key(texts[name]), result)
                say(
                    f"  {name}: {result['seconds']:.0f} s, "
                    f"final val_loss {result['evals'][-1][1]:.4f}"
                )
    return out


def store(path: Path, key: str, value: dict[str, Any]) -> None:
    """`value` under `key` in the cache file, whatever else it holds (re-read first)."""
    cache = load_cache(path)
    cache[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(path)


def steps_to(evals: list[list[float]] | list[tuple[int, float]], target: float) -> int | None:
    for step, loss in evals:
        if loss <= target:
            return int(step)
    return None


# ---------------------------------------------------------------------------------------------
# Step time, shaped links


@dataclass(frozen=True)
class Link:
    name: str
    rate_bits: float | None
    delay_ms: float


def parse_link(text: str) -> Link:
    match = re.fullmatch(r"([^+]+)(?:\+(\d+(?:\.\d+)?)ms)?", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"link {text!r}: use RATE[+DELAYms], e.g. 100mbit+50ms")
    return Link(text.strip().lower(), wan.parse_rate(match.group(1)), float(match.group(2) or 0))


def host_layout() -> tuple[list[list[str]], dict[str, str]]:
    """Per stage its replicas' hosts, and every host's address (the trainer's first)."""
    hosts = [[f"s{k}r{j}" for j in range(REPLICAS)] for k in range(STAGES)]
    servers = [h for stage in hosts for h in stage]
    addresses = {wan.TRAINER: f"{wan.SUBNET}.10"}
    addresses |= {h: f"{wan.SUBNET}.{11 + i}" for i, h in enumerate(servers)}
    return hosts, addresses


def scrape(net: Network, listen: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per stage server: the averaging bytes it sent as a contributor and received back as sums
    (its /metrics, read inside its namespace), and the bytes its link carried out (tbf's
    counter), all read at once."""
    calls = {
        host: subprocess.Popen(
            [
                *("ip", "netns", "exec", net.ns[host], "curl", "-s", "--max-time", "10"),
                f"http://{listen[host]}:{METRICS_PORT}/metrics",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        for host in listen
    }
    links = net.counters()
    out = {}
    for host, proc in calls.items():
        text, _ = proc.communicate(timeout=30)
        got = {"sent": 0.0, "received": 0.0, "link_out": float(links[host][0])}
        for line in text.decode(errors="replace").splitlines():
            for key, metric in (("sent", SENT_METRIC), ("received", RECEIVED_METRIC)):
                if line.startswith(metric + "{") or line.startswith(metric + " "):
                    got[key] += float(line.rsplit(None, 1)[1])
        out[host] = got
    return out


def steady(periods: list[float], agree: float) -> tuple[int, bool] | None:
    """The first window of three consecutive ones within `agree` of their mean, and True; None
    while there is none."""
    for i in range(len(periods) - 2):
        three = periods[i : i + 3]
        mean = sum(three) / 3
        if all(abs(p - mean) <= agree * mean for p in three):
            return i, True
    return None


def launch(
    net: Network, job: Path, link: Link, label: str, work: Path, procs: list[Proc]
) -> tuple[Path, Proc, dict[str, str]]:
    """Fresh stage servers (2 stages x 2 replicas, /metrics on), the relays when `link` has a
    delay, and the trainer, its --log; appended to `procs`. (The log, the trainer, each server's
    listening address.)"""
    hosts, address = host_layout()
    relayed = link.delay_ms > 0
    net.shape(link.rate_bits)
    servers = [(k, host) for k, stage in enumerate(hosts) for host in stage]
    listen = {host: "127.0.0.1" if relayed else address[host] for _, host in servers}
    start_at = len(procs)
    for k, host in servers:
        flags = f"--stage {k} --host {listen[host]} --port {wan.PORT} --device cpu --threads 1"
        flags += f" --metrics-port {METRICS_PORT} --insecure-no-token"  # namespaces here alone
        argv = wan.swarm_cmd("stage-server", "--job", str(job), *flags.split())
        procs.append(wan.start(net, host, f"{label}-{host}", argv, work))
    deadline = time.monotonic() + wan.READY_TIMEOUT_S
    for proc in procs[start_at:]:
        proc.wait_ready(deadline)
    if relayed:
        for _, host in servers:
            relay = [sys.executable, str(Path(wan.__file__).resolve()), "--relay"]
            relay += [f"{address[host]}:{wan.PORT}", f"127.0.0.1:{wan.PORT}"]
            relay += [str(link.delay_ms)]
            procs.append(wan.start(net, host, f"{label}-relay-{host}", relay, work))
        deadline = time.monotonic() + 60
        for proc in procs[start_at + len(servers) :]:
            proc.wait_ready(deadline)
    log = work / f"{label}-steps.jsonl"
    stage_servers = ",".join("|".join(f"{address[h]}:{wan.PORT}" for h in stage) for stage in hosts)
    argv = wan.swarm_cmd("trainer", "--job", str(job), "--threads", "1", "--log", str(log))
    trainer = wan.start(
        net, wan.TRAINER, f"{label}-trainer", [*argv, "--stage-servers", stage_servers], work
    )
    procs.append(trainer)
    return log, trainer, listen


def check_alive(procs: list[Proc], label: str) -> None:
    for proc in procs:
        if proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode} during {label}:\n"
                f"{proc.log()[-3000:]}"
            )


def watch(
    count: Callable[[], int],
    at_edge: Callable[[], Future[dict[str, dict[str, float]]]],
    w: int,
    args: argparse.Namespace,
    check: Callable[[], None],
    why: Callable[[], str],
) -> tuple[list[float], dict[int, Future[dict[str, dict[str, float]]]], tuple[int, bool]]:
    """Steps as `count()` sees them done (polled), cut into windows of `w` after the warm-up,
    `at_edge()` started at each window's edge (its scrape), until three windows agree (`steady`)
    or `--max-windows` passed: the windows' mean step times, the edges' scrapes by step count,
    and (the first of the three, whether steady). `check()` raises when a process died."""
    arrived: list[float] = []  # arrived[i]: when step i was seen done
    edges: dict[int, Future[dict[str, dict[str, float]]]] = {}  # step count -> the scrape there
    periods: list[float] = []
    deadline = time.monotonic() + args.timeout
    while True:
        done = count()
        now = time.monotonic()
        while len(arrived) < done:
            arrived.append(now)
            n = len(arrived)
            if n >= WARMUP_STEPS and (n - WARMUP_STEPS) % w == 0:
                edges[n] = at_edge()
                if n > WARMUP_STEPS:
                    periods.append((arrived[n - 1] - arrived[n - 1 - w]) / w)
        if len(periods) >= 3:
            found = steady(periods, args.agree)
            if found is None and len(periods) >= args.max_windows:
                found = (len(periods) - 3, False)
            if found is not None:
                return periods, edges, found
        check()
        if now > deadline:
            raise TimeoutError(
                f"{len(periods)} windows in {args.timeout:.0f}s, no steady three; {why()}"
            )
        time.sleep(0.01)


def measure(
    net: Network,
    mode: Mode,
    link: Link,
    args: argparse.Namespace,
    work: Path,
    procs: list[Proc],
) -> dict[str, Any]:
    """The row's steady step time over `link`, on a fresh swarm; every process killed after."""
    w = mode.window
    steps = WARMUP_STEPS + args.max_windows * w + 2  # never the job's end while measured
    text = job_text(args.workload, mode, steps, 0, args.outer, args.compression)
    label = f"{link.name.replace('+', '_')}-{mode.name.replace('+', '_')}"
    job = work / f"{label}.toml"
    job.write_text(text)
    start_at = len(procs)
    metrics = ThreadPoolExecutor(max_workers=1)
    try:
        log, trainer, listen = launch(net, job, link, label, work, procs)
        periods, edges, (first, is_steady) = watch(
            lambda: wan.count_lines(log),
            lambda: metrics.submit(scrape, net, listen),
            w,
            args,
            lambda: check_alive(procs[start_at:], label),
            lambda: f"{label}: trainer log:\n{trainer.log()[-3000:]}",
        )
        lo = WARMUP_STEPS + first * w  # line counts at the three windows' edges
        hi = lo + 3 * w
        before, after = edges[lo].result(timeout=60), edges[hi].result(timeout=60)
    finally:
        metrics.shutdown(wait=True)
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    records = [json.loads(line) for line in log.read_text().splitlines()[lo:hi]]
    window_means = periods[first : first + 3]
    step_s = sum(window_means) / 3
    blocked = sum(r.get("blocked_seconds", 0.0) for r in records) / len(records)
    per_step = {h: {k: (after[h][k] - before[h][k]) / (hi - lo) for k in after[h]} for h in after}
    # A replica's averaging output: its contributions to the parts others own (`sent`) and the
    # sums of the part it owns, which every other member receives (`received`, summed over the
    # pool: the same bytes). Payload bytes, without TCP/HTTP/2 framing.
    averaging = sum(v["sent"] + v["received"] for v in per_step.values()) / len(per_step)
    return {
        "mode": mode.name,
        "link": link.name,
        "step_seconds": step_s,
        "steady": is_steady,
        "windows": periods,
        "window_steps": w,
        "steady_windows": [first, first + 3],
        "blocked_seconds_per_step": blocked,
        "blocked_share": blocked / step_s,
        "averaging_bytes_per_replica_step": averaging,
        "link_bytes_out_per_server_step": sum(v["link_out"] for v in per_step.values())
        / len(per_step),
        "bytes_per_step_by_host": per_step,
    }


# ---------------------------------------------------------------------------------------------
# Uneven links: equal vs water-filled parts (issue 43)

UNEVEN_REPLICAS = 3  # a pool of 3: with 2 contributors no partition changes a round's time
SCHEDULER_PORT, BROKER_PORT, SCHEDULER_METRICS_PORT = 7400, 1883, 9200
UNEVEN_ROWS = ("equal", "water-filled")
# Steps the job may take before all three are members (those placed as copies join a step
# boundary or more after the start): the windows count from then on.
JOIN_SLACK_STEPS = 40


@dataclass(frozen=True)
class Uneven:
    """One stage's pool of `UNEVEN_REPLICAS` hosts: `u0`'s uplink at `slow_bits`, every other
    link at `fast_bits`."""

    name: str
    slow_bits: float
    fast_bits: float

    @property
    def hosts(self) -> list[str]:
        return [f"u{j}" for j in range(UNEVEN_REPLICAS)]

    def bandwidth(self, host: str, water: bool) -> str:
        """The `--bandwidth` `host` announces: its real links for water-filled parts, the fast
        rate for everyone for equal parts (water-filling gives equal rates equal parts)."""
        fast = f"{int(self.fast_bits)}bit"
        return f"{int(self.slow_bits)}bit/{fast}" if water and host == "u0" else fast

    def rates(self) -> list[float]:
        """Each member's upload, bytes/s (what the coordinator sizes parts by)."""
        return [(self.slow_bits if h == "u0" else self.fast_bits) / 8 for h in self.hosts]


def parse_uneven(text: str) -> Uneven | None:
    if text.strip().lower() in ("", "none"):
        return None
    slow, sep, fast = text.strip().lower().partition("/")
    rates = (wan.parse_rate(slow), wan.parse_rate(fast)) if sep else (None, None)
    if rates[0] is None or rates[1] is None or not rates[0] < rates[1]:
        raise argparse.ArgumentTypeError(f"--uneven {text!r}: use SLOW/FAST, e.g. 10mbit/100mbit")
    return Uneven(text.strip().lower(), rates[0], rates[1])


def uneven_addresses(uneven: Uneven) -> dict[str, str]:
    return {h: f"{wan.SUBNET}.{31 + j}" for j, h in enumerate(uneven.hosts)}


def shape_uneven(net: Network, uneven: Uneven) -> None:
    """Every link at the fast rate, then `u0`'s uplink at the slow one: per direction with the
    lab harness's `shape_host` where it has it, else tbf on `u0`'s own end (its upload)."""
    net.shape(uneven.fast_bits)
    shape_host = getattr(net, "shape_host", None)
    if shape_host is not None:
        shape_host("u0", uneven.slow_bits, uneven.fast_bits)
        return
    burst = max(128 << 10, int(uneven.slow_bits / 8 / 100))  # as Network.shape sizes it
    tbf = f"tbf rate {int(uneven.slow_bits)}bit burst {burst} latency 100ms".split()
    sh = ("ip", "netns", "exec", net.ns["u0"], "tc", "qdisc", "replace", "dev", "eth0", "root")
    subprocess.run([*sh, *tbf], check=True, capture_output=True, timeout=30)


def scheduler_metric(net: Network, name: str) -> float:
    """The sum of `name`'s samples on the scheduler's /metrics (read inside its namespace)."""
    url = f"http://{wan.SUBNET}.10:{SCHEDULER_METRICS_PORT}/metrics"
    cmd = ["ip", "netns", "exec", net.ns[wan.TRAINER], "curl", "-s", "--max-time", "5", url]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    return sum(
        float(line.rsplit(None, 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def measure_uneven(
    net: Network,
    uneven: Uneven,
    water: bool,
    args: argparse.Namespace,
    work: Path,
    procs: list[Proc],
) -> dict[str, Any]:
    """Sync's steady step time on one stage's pool over `uneven` links, under a scheduler (the
    parts follow the rates the peers announce), parts equal or water-filled; every process
    killed after."""
    mode = parse_mode("sync", args.compression)
    steps = JOIN_SLACK_STEPS + WARMUP_STEPS + args.max_windows * mode.window + 2
    text = job_text(args.workload, mode, steps, 0, args.outer, "none")
    text = text.replace(f"stages = {STAGES}\n", "stages = 1\n")  # one pool of them all
    label = f"uneven-{UNEVEN_ROWS[water]}"
    job = work / f"{label}.toml"
    job.write_text(text)
    shape_uneven(net, uneven)
    start_at, here = len(procs), uneven_addresses(uneven)
    metrics = ThreadPoolExecutor(max_workers=1)
    try:
        head = f"--host {wan.SUBNET}.10 --port {SCHEDULER_PORT} --broker-port {BROKER_PORT}"
        head += f" --metrics-port {SCHEDULER_METRICS_PORT} --insecure-no-token"
        head += f" --store {work}/{label}.sqlite --checkpoint-dir {work}/{label}-ckpt"
        head += f" --data-root {CORPUS.parent} --dial-private"  # the namespaces' private ranges
        scheduler = wan.start(
            net, wan.TRAINER, f"{label}-scheduler", wan.swarm_cmd("scheduler", *head.split()), work
        )
        procs.append(scheduler)
        broker = scheduler.wait_ready(time.monotonic() + wan.READY_TIMEOUT_S)["broker"]

        def server(host: str) -> Proc:
            flags = f"--broker {broker} --host {here[host]} --port {wan.PORT} --device cpu"
            flags += f" --threads 1 --metrics-port {METRICS_PORT} --insecure-no-token"
            flags += f" --peer {host} --bandwidth {uneven.bandwidth(host, water)}"
            argv = wan.swarm_cmd("stage-server", *flags.split())
            proc = wan.start(net, host, f"{label}-{host}", argv, work)
            procs.append(proc)
            return proc

        # The fast ones first, the job on them, then u0: a replica placed later joins as a copy
        # of a member, and a copy taken over u0's slow uplink was seen never to catch up with
        # the steps (the whole run trained on u0 alone).
        deadline = time.monotonic() + wan.READY_TIMEOUT_S
        for proc in [server(h) for h in uneven.hosts[1:]]:
            proc.wait_ready(deadline)
        at = f"{wan.SUBNET}.10:{SCHEDULER_PORT}"
        submit = wan.swarm_cmd("submit", str(job), "--scheduler", at)
        submitted = wan.start(net, wan.TRAINER, f"{label}-submit", submit, work)
        procs.append(submitted)
        server("u0").wait_ready(deadline)
        p = WORKLOADS[args.workload]
        tokens = p["target_batch_size"] * p["seq_len"]  # per step: the coordinator counts them
        listen = {h: here[h] for h in uneven.hosts}
        alive = [p for p in procs[start_at:] if p is not submitted]  # submit exits, done

        def committed() -> int:
            return int(scheduler_metric(net, "swarm_coordinator_tokens_total") // tokens)

        # Measured once the pool is whole: every member has sent averaging bytes (a copy not
        # yet admitted sends none, and no member leaves a healthy run).
        deadline = time.monotonic() + args.timeout
        while not all(v["sent"] > 0 for v in scrape(net, listen).values()):
            check_alive(alive, label)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: the pool of 3 never met: {scheduler.log()[-3000:]}")
            time.sleep(0.2)
        base = committed()
        periods, edges, (first, is_steady) = watch(
            lambda: committed() - base,
            lambda: metrics.submit(scrape, net, listen),
            mode.window,
            args,
            lambda: check_alive(alive, label),
            lambda: f"{label}: scheduler log:\n{scheduler.log()[-3000:]}",
        )
        lo = WARMUP_STEPS + first * mode.window
        hi = lo + 3 * mode.window
        before, after = edges[lo].result(timeout=60), edges[hi].result(timeout=60)
    finally:
        metrics.shutdown(wait=True)
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    step_s = sum(periods[first : first + 3]) / 3
    per_step = {h: {k: (after[h][k] - before[h][k]) / (hi - lo) for k in after[h]} for h in after}
    return {
        "parts": UNEVEN_ROWS[water],
        "link": uneven.name,
        "bandwidth": {h: uneven.bandwidth(h, water) for h in uneven.hosts},
        "step_seconds": step_s,
        "steady": is_steady,
        "windows": periods,
        "window_steps": mode.window,
        # Per member: what it sent averaging (a client sends its whole vector; an owner less
        # its own part), and what its link carried out (tbf's counter).
        "bytes_per_step_by_host": per_step,
    }


def uneven_bound(uneven: Uneven, workload: str) -> dict[str, float]:
    """The round times the LP's model gives for one step's vector over these rates: equal
    parts, water-filled, and their ratio (`swarm.policy.parts`)."""
    from swarm.model.transformer import stage_layout
    from swarm.policy.parts import round_time, water_fill

    text = job_text(workload, parse_mode("sync", "none"), 1, 0, (0.7, 0.9), "none")
    job = parse_job(text.replace(f"stages = {STAGES}\n", "stages = 1\n"), ROOT, "ttl")
    nbytes = 4 * sum(p.numel() for p in stage_layout(job, 0).parameters())  # float32
    rates = uneven.rates()
    equal = round_time(rates, [], len(rates), nbytes)
    water = round_time(rates, water_fill(rates), len(rates), nbytes)
    return {"vector_bytes": nbytes, "equal_s": equal, "water_s": water, "ratio": equal / water}


def swarm_curve(
    net: Network,
    mode: Mode,
    args: argparse.Namespace,
    target: float,
    work: Path,
    procs: list[Proc],
) -> dict[str, Any]:
    """A compressed row's evaluations on a real swarm with the links off (no tbf, no relay): the
    trainer's --log, every --eval-every steps, until one reaches `target` or the job ends."""
    text = job_text(
        args.workload, mode, args.max_steps, args.eval_every, args.outer, args.compression
    )
    label = f"steps-{mode.name.replace('+', '_')}"
    job = work / f"{label}.toml"
    job.write_text(text)
    start_at = len(procs)
    evals: list[tuple[int, float]] = []
    began, reached, seen = time.monotonic(), False, 0
    try:
        log, trainer, _ = launch(net, job, Link("off", None, 0.0), label, work, procs)
        deadline = began + args.swarm_timeout
        while True:
            ended = trainer.popen.poll() == 0  # the job's end: read the log once more
            try:
                lines = log.read_bytes().split(b"\n")[:-1]  # whole lines only
            except OSError:
                lines = []
            for line in lines[seen:]:
                record = json.loads(line)
                if record.get("val_loss") is not None:
                    evals.append((int(record["step"]), float(record["val_loss"])))
                    reached = reached or record["val_loss"] <= target
            seen = len(lines)
            if reached or ended:
                break
            check_alive(procs[start_at:], label)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{label}: {seen} steps in {args.swarm_timeout:.0f}s; trainer log:\n"
                    f"{trainer.log()[-3000:]}"
                )
            time.sleep(0.2)
    finally:
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    return {
        "mode": mode.name,
        "text": text,
        "source": "swarm",
        "evals": evals,
        "target": target,
        "stopped_at_target": reached,
        "seconds": time.monotonic() - began,
    }


def check_root() -> str | None:
    """Why the shaped part cannot run here (wan.py's checks: root, iproute2), or None."""
    # wan.py's own defaults for every option not named (a Namespace built here lacked those
    # wan.py added later: `standby`, `control`)
    probe = wan.parse_args(
        f"--rate none --steps 1 --replicas {REPLICAS} --small --data-plane relay".split()
    )
    problem = wan.check(probe)
    if problem is None and shutil.which("curl") is None:
        problem = "needs curl (to read the stage servers' /metrics inside their namespaces)"
    return problem


def _alive(pid: int) -> bool:
    try:
        return b"time_to_loss.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def shaped(
    args: argparse.Namespace, modes: list[Mode], links: list[Link], target: float
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The rows' step times over every link, and (--swarm-steps) the named compressed rows'
    evaluations on a real swarm with the links off."""
    work = Path(tempfile.mkdtemp(prefix="swarm-ttl-"))
    _, address = host_layout()
    if args.uneven is not None:
        address |= uneven_addresses(args.uneven)
    net = Network(PREFIX, address)
    procs: list[Proc] = []
    rows: list[dict[str, Any]] = []
    curves_: dict[str, dict[str, Any]] = {}
    ok, failed = False, False
    try:
        removed = remove_leftovers(PREFIX, _alive)
        if removed:
            say(f"removed leftover namespaces: {', '.join(removed)}")
        net.create()
        for mode in (m for m in modes if m.name in args.swarm_steps):
            cached = swarm_cached(args, mode, target)
            if cached is not None:
                curves_[mode.name] = cached
                continue
            say(f"swarm run, links off: {mode.name}'s steps to {target:.4f} ...")
            try:
                curve = swarm_curve(net, mode, args, target, work, procs)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                say(f"  FAILED (its steps stay its rule's, uncompressed): {first}")
                say(str(e)[-2000:])
                failed = True
                continue
            at = steps_to(curve["evals"], target)
            say(f"  reached at step {at} ({curve['seconds']:.0f} s)")
            curves_[mode.name] = curve
            store(args.cache, cache_key(curve["text"] + SWARM_KEY), curve)
        for link in links:
            for mode in modes:
                say(f"shaped run: {mode.name} over {link.name} ...")
                try:
                    row = measure(net, mode, link, args, work, procs)
                except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                    # One row's failure (a process exiting, a timeout) leaves the others to run.
                    lines = str(e).strip().splitlines()
                    error = lines[0] if lines else type(e).__name__  # what failed, not its log
                    say(f"  FAILED: {error}\n{str(e)[-2000:]}")
                    rows.append({"mode": mode.name, "link": link.name, "error": error})
                    failed = True
                    continue
                say(
                    f"  {row['step_seconds']:.3f} s/step"
                    f"{'' if row['steady'] else ' (not steady)'}, windows "
                    + ", ".join(f"{p:.2f}" for p in row["windows"])
                    + f"; blocked {row['blocked_share']:.0%}; averaging "
                    f"{row['averaging_bytes_per_replica_step'] / 1e6:.2f} MB/replica/step"
                )
                rows.append(row)
        for water in (False, True) if args.uneven is not None else ():
            say(f"shaped run: sync over {args.uneven.name}, {UNEVEN_ROWS[water]} parts ...")
            try:
                row = measure_uneven(net, args.uneven, water, args, work, procs)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
                lines = str(e).strip().splitlines()
                error = lines[0] if lines else type(e).__name__
                say(f"  FAILED: {error}\n{str(e)[-2000:]}")
                rows.append({"parts": UNEVEN_ROWS[water], "link": args.uneven.name, "error": error})
                failed = True
                continue
            say(f"  {row['step_seconds']:.3f} s/step{'' if row['steady'] else ' (not steady)'}")
            rows.append(row)
        ok = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in procs:
            proc.kill()
        net.destroy()
        if ok and not failed and not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs in {work}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return rows, curves_


def swarm_cached(args: argparse.Namespace, mode: Mode, target: float) -> dict[str, Any] | None:
    """A cached swarm curve of `mode` that answers `target`: one that ran to its job's end, or
    stopped at a target no lower than this one."""
    text = job_text(
        args.workload, mode, args.max_steps, args.eval_every, args.outer, args.compression
    )
    hit = load_cache(args.cache).get(cache_key(text + SWARM_KEY))
    if hit is None or hit.get("text") != text:
        return None
    if hit["stopped_at_target"] and hit["target"] > target:
        return None
    return hit  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# Report


def report(
    args: argparse.Namespace,
    modes: list[Mode],
    links: list[Link],
    evals: dict[str, dict[str, Any]],
    timed: list[dict[str, Any]],
    swarm: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    sync_evals = dict((int(s), v) for s, v in evals["sync"]["evals"])
    target = sync_evals[args.target_step]
    # A row's evaluations: its own on a swarm (--swarm-steps), else its rule's in one process.
    curve = {m.name: (swarm.get(m.name) or evals[m.base])["evals"] for m in modes}
    steps = {m.name: steps_to(curve[m.name], target) for m in modes}
    uncompressed = {m.name: m.compressed and m.name not in swarm for m in modes}
    out: dict[str, Any] = {
        "workload": {
            "name": args.workload,
            **WORKLOADS[args.workload],
            "stages": STAGES,
            "replicas": REPLICAS,
            "data_plane": "relay",
            "dtype": "float32",
        },
        "target": {
            "val_loss": target,
            "sync_step": args.target_step,
            "eval_every": args.eval_every,
            "max_steps": args.max_steps,
        },
        "outer": {"lr": args.outer[0], "momentum": args.outer[1]},
        "compression": args.compression,
        "steps": {
            m.name: {
                "steps_to_target": steps[m.name],
                "from": "swarm, links off" if m.name in swarm else f"reference {m.base}",
                "uncompressed_rule": uncompressed[m.name],
                "last_val_step": curve[m.name][-1][0],
                "last_val_loss": curve[m.name][-1][1],
            }
            for m in modes
        },
        "curves": {name: e["evals"] for name, e in evals.items()},
        "swarm_curves": {name: e["evals"] for name, e in swarm.items()},
        "links": [],
    }
    for link in links:
        rows = {r["mode"]: r for r in timed if r["link"] == link.name and "mode" in r}
        if not rows:
            continue
        sync_t = None
        if "step_seconds" in rows.get("sync", {}) and steps.get("sync") is not None:
            sync_t = steps["sync"] * rows["sync"]["step_seconds"]
        table = []
        for m in modes:
            r = rows.get(m.name)
            if r is None:
                continue
            n = steps[m.name]
            t = n * r["step_seconds"] if n is not None and "error" not in r else None
            table.append(
                {
                    **r,
                    "steps_to_target": n,
                    "uncompressed_rule": uncompressed[m.name],
                    "T_seconds": t,
                    "T_over_sync": t / sync_t if t is not None and sync_t else None,
                }
            )
        lows = [x for x in table if x["mode"] != "sync" and x["T_over_sync"] is not None]
        best = min(lows, key=lambda x: x["T_over_sync"]) if lows else None
        goal = GOALS.get(link.name)
        out["links"].append(
            {
                "link": link.name,
                "rate_bits_per_s": link.rate_bits,
                "delay_ms": link.delay_ms,
                "rows": table,
                "best": None
                if best is None
                else {"mode": best["mode"], "T_over_sync": best["T_over_sync"]},
                "goal": goal,
                "goal_met": None if goal is None or best is None else best["T_over_sync"] <= goal,
                "sync_blocked_share": rows.get("sync", {}).get("blocked_share"),
            }
        )
    uneven = [r for r in timed if "parts" in r]
    if uneven and args.uneven is not None:
        sync_steps = steps.get("sync")
        table = [
            {
                **r,
                "steps_to_target": sync_steps,
                "T_seconds": None
                if "error" in r or sync_steps is None
                else sync_steps * r["step_seconds"],
            }
            for r in uneven
        ]
        t = {r["parts"]: r["T_seconds"] for r in table}
        both = t.get("equal") and t.get("water-filled")
        out["uneven"] = {
            "link": args.uneven.name,
            "replicas": UNEVEN_REPLICAS,
            "stages": 1,
            "rows": table,
            "equal_over_water": t["equal"] / t["water-filled"] if both else None,
            "bound": uneven_bound(args.uneven, args.workload),
        }
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(r: dict[str, Any], out: IO[str]) -> None:
    w, t = r["workload"], r["target"]
    print(
        f"workload {w['name']}: byte gpt d_model {w['d_model']}, {w['n_layers']} blocks, "
        f"{w['n_heads']} heads, seq {w['seq_len']}; {w['stages']} stages x {w['replicas']} "
        f"replicas; {w['microbatch_size']} x {w['target_batch_size'] // w['microbatch_size']} "
        f"samples per step; {w['dtype']}, carry plane; outer {r['outer']['lr']}:"
        f"{r['outer']['momentum']}",
        file=out,
    )
    print(
        f"target: val_loss {t['val_loss']:.4f} = sync's at step {t['sync_step']} (evaluated every "
        f"{t['eval_every']} steps to {t['max_steps']}, links off)",
        file=out,
    )
    print(f"{'mode':<14} {'steps':>6} {'last val (step)':>17}  from", file=out)
    for name, s in r["steps"].items():
        note = "; steps: uncompressed rule" if s["uncompressed_rule"] else ""
        last = f"{s['last_val_loss']:.4f} ({s['last_val_step']})"
        print(
            f"{name:<14} {fmt(s['steps_to_target'], 'd'):>6} {last:>17}  {s['from']}{note}",
            file=out,
        )
    for link in r["links"]:
        print(file=out)
        print(
            f"link {link['link']} (each way per host). avg MB/repl/step: averaging payload each "
            "replica sends per step (/metrics); link MB/srv/step: all a stage server's link "
            "carried out (tbf); blocked: the trainer's blocked seconds over the step",
            file=out,
        )
        print(
            f"{'mode':<14} {'steps':>6} {'s/step':>8} {'T s':>9} {'T/T_sync':>9} "
            f"{'avg MB/repl/step':>17} {'link MB/srv/step':>17} {'blocked':>8}  notes",
            file=out,
        )
        for x in link["rows"]:
            if "error" in x:
                steps = fmt(x["steps_to_target"], "d")
                print(f"{x['mode']:<14} {steps:>6}  FAILED: {x['error'][:200]}", file=out)
                continue
            notes = []
            if x["uncompressed_rule"]:
                notes.append("steps: uncompressed rule")
            if not x["steady"]:
                notes.append("not steady")
            print(
                f"{x['mode']:<14} {fmt(x['steps_to_target'], 'd'):>6} "
                f"{x['step_seconds']:>8.3f} {fmt(x['T_seconds'], '.1f'):>9} "
                f"{fmt(x['T_over_sync'], '.3f'):>9} "
                f"{x['averaging_bytes_per_replica_step'] / 1e6:>17.3f} "
                f"{x['link_bytes_out_per_server_step'] / 1e6:>17.3f} "
                f"{x['blocked_share']:>8.1%}  {'; '.join(notes)}",
                file=out,
            )
        if link["sync_blocked_share"] is not None:
            share = link["sync_blocked_share"]
            verdict = "holds" if share >= 0.5 else "does NOT hold"
            print(
                f"sync's commit (averaging) blocks {share:.0%} of its step: the >= 50% claim "
                f"{verdict}",
                file=out,
            )
        if link["best"] is not None:
            goal = link["goal"]
            met = (
                ""
                if goal is None
                else f"; goal <= {goal}: {'met' if link['goal_met'] else 'NOT met'}"
            )
            print(
                f"best low-communication row: {link['best']['mode']}, T/T_sync "
                f"{link['best']['T_over_sync']:.3f}{met}",
                file=out,
            )

    u = r.get("uneven")
    if u is not None:
        print(file=out)
        print(
            f"uneven links {u['link']} (u0's uplink slow, every other link fast): sync, 1 stage x "
            f"{u['replicas']} replicas under a scheduler; steps: sync's (the parts change no "
            "sum); parts equal (every member announces the fast rate) or water-filled (each its "
            "own: u0 a client)",
            file=out,
        )
        print(f"{'parts':<14} {'steps':>6} {'s/step':>8} {'T s':>9}  u0 MB sent/step", file=out)
        for x in u["rows"]:
            if "error" in x:
                print(f"{x['parts']:<14}  FAILED: {x['error'][:200]}", file=out)
                continue
            sent = x["bytes_per_step_by_host"].get("u0", {}).get("sent", 0.0) / 1e6
            note = "" if x["steady"] else "  not steady"
            print(
                f"{x['parts']:<14} {fmt(x['steps_to_target'], 'd'):>6} {x['step_seconds']:>8.3f} "
                f"{fmt(x['T_seconds'], '.1f'):>9}  {sent:.3f}{note}",
                file=out,
            )
        b = u["bound"]
        print(
            f"T equal / T water-filled: {fmt(u['equal_over_water'], '.3f')}; the LP's bound for "
            f"a round of {b['vector_bytes'] / 1e6:.1f} MB: {b['equal_s']:.2f} s equal, "
            f"{b['water_s']:.2f} s water-filled ({b['ratio']:.3f}x)",
            file=out,
        )


# ---------------------------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_outer(text: str) -> tuple[float, float]:
    try:
        lr, momentum = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--outer {text!r}: use LR:MOMENTUM, e.g. 0.7:0.9"
        ) from None
    return lr, momentum


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="d320")
    parser.add_argument("--modes", help="rows, comma-separated (default: every row)")
    parser.add_argument(
        "--compression",
        default="int8_blockwise",
        help="the +int8 rows' [compression] averaging codec; none drops those rows",
    )
    parser.add_argument("--links", default="20mbit,100mbit+50ms", help="RATE[+DELAYms],...")
    parser.add_argument(
        "--outer", type=parse_outer, default=(0.7, 0.9), help="local rows' outer LR:MOMENTUM"
    )
    parser.add_argument(
        "--uneven",
        type=parse_uneven,
        default=parse_uneven("10mbit/100mbit"),
        help="SLOW/FAST: sync on a pool of 3 whose one uplink is SLOW, equal vs water-filled "
        "parts (issue 43); none skips it",
    )
    parser.add_argument("--max-steps", type=int, default=480)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--target-step", type=int, default=240)
    parser.add_argument("--workers", type=int, default=2, help="trainings at a time (links off)")
    parser.add_argument("--cache", type=Path, default=BENCH / ".time_to_loss_steps.json")
    parser.add_argument("--agree", type=float, default=0.05, help="steady: windows within this")
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per shaped run")
    parser.add_argument("--steps-only", action="store_true", help="skip the shaped runs")
    parser.add_argument(
        "--swarm-steps",
        default="",
        help="compressed rows (e.g. sync+int8) whose steps to measure on a real swarm, links off",
    )
    parser.add_argument(
        "--swarm-timeout", type=float, default=3600.0, help="seconds per --swarm-steps run"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


def validate(args: argparse.Namespace) -> tuple[list[Mode], list[Link]]:
    codecs = ("none", "fp16", "bf16", "int8_blockwise", "hadamard3")
    if args.compression not in codecs:
        raise ValueError(f"--compression {args.compression!r}: one of {', '.join(codecs)}")
    names = args.modes.split(",") if args.modes else default_modes(args.compression)
    modes = [parse_mode(n, args.compression) for n in names if n.strip()]
    if len({m.name for m in modes}) != len(modes) or not modes:
        raise ValueError("--modes: name each row once")
    links = [parse_link(x) for x in args.links.split(",") if x.strip()]
    args.swarm_steps = [x.strip() for x in args.swarm_steps.split(",") if x.strip()]
    compressed = {m.name for m in modes if m.compressed}
    eager = {m.name for m in modes if m.eager}
    for name in args.swarm_steps:
        if name not in compressed or name in eager:
            raise ValueError(
                f"--swarm-steps {name}: not a compressed row of --modes (eager rows evaluate "
                "only in the reference)"
            )
    if args.eval_every < 1 or args.max_steps < args.eval_every:
        raise ValueError("--eval-every must be >= 1 and at most --max-steps")
    if args.target_step % args.eval_every or not 0 < args.target_step <= args.max_steps:
        raise ValueError("--target-step must be a multiple of --eval-every in 1..--max-steps")
    for m in modes:
        if args.eval_every % m.h:
            raise ValueError(f"--eval-every {args.eval_every} is not a multiple of {m.name}'s H")
    if not 0 < args.agree < 1 or args.max_windows < 3 or args.workers < 1:
        raise ValueError("--agree in (0, 1), --max-windows >= 3, --workers >= 1")
    for m in modes:  # every job must load before an hour is spent
        for steps, every, codec in (
            (args.max_steps, args.eval_every, "none"),
            (10, 0, args.compression),
        ):
            try:
                parse_job(job_text(args.workload, m, steps, every, args.outer, codec), ROOT, "ttl")
            except ConfigError as e:
                raise ValueError(f"{m.name}'s job would not load: {e}") from None
    return modes, links


def main() -> int:
    args = parse_args()
    try:
        modes, links = validate(args)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"bench/time_to_loss.py: {e}", file=sys.stderr)
        return 2
    if not args.steps_only:
        problem = check_root()
        if problem:
            print(f"bench/time_to_loss.py: {problem} (--steps-only runs without)", file=sys.stderr)
            return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        evals = curves(args, modes)
        target = dict((int(s), v) for s, v in evals["sync"]["evals"]).get(args.target_step)
        if target is None or not math.isfinite(target):
            print(
                f"bench/time_to_loss.py: sync has no validation loss at step {args.target_step}",
                file=sys.stderr,
            )
            return 1
        if args.steps_only:  # --swarm-steps rows from the cache only (they need root)
            timed: list[dict[str, Any]] = []
            swarm: dict[str, dict[str, Any]] = {}
            for m in (m for m in modes if m.name in args.swarm_steps):
                if (hit := swarm_cached(args, m, target)) is not None:
                    swarm[m.name] = hit
        else:
            timed, swarm = shaped(args, modes, links, target)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        print(f"bench/time_to_loss.py: {e}", file=sys.stderr)
        return 1
    result = report(args, modes, links, evals, timed, swarm)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
