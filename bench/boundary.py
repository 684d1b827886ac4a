"""The boundary's score (issue 52): time to a target loss when the links between stages, not the
compute, decide, for the full boundary and a small one, each with and without a codec,

    T = steps to a target validation loss x steady step time (ProtocolNanoGPT's definition),

all rows measured in one run, over links shaped from this run's own unshaped compute rate.

    sudo .venv/bin/python bench/boundary.py
        [--rows full,full+table,full+codec,subspace,subspace+codec]
        [--codec hadamard3] [--rank 48[,96...]] [--subspace-keys "k = v; ..."] [--bottleneck R]
        [--factor 32,64] [--seeds 3]
        [--workload d320|small] [--max-steps 480]
        [--eval-every 16] [--target-step 240] [--agree 0.05] [--max-windows 6]
        [--timeout 1800] [--quick] [--keep-logs] [--json]

The workload is bench/time_to_loss.py's (a byte-level GPT, d_model 320, on the bundled
`examples/data/corpus.txt` with 10% held out, 32 samples of 32 tokens per step, AdamW lr 1e-3,
float32) cut into 4 stages of one block each, on the push plane: 4 stage servers, each a host of
its own in a network namespace (bench/wan.py's `Network`), and the trainer in a fifth.

Rows (`--rows`): `full` (today's boundary: d_model float32 values per token), `full+table` (the
control of the subspace rows' fixed table, below), `full+codec`
(`[compression] wire = --codec`, both directions), `subspace` (`[model] boundary_rank =
--rank`: the subspace boundary), `subspace+codec` (both); `+codec` may also be written with the
codec's name (`full+hadamard3`). `--rank 48,96` scores several ranks in the one run: each
subspace row once per rank, named with it (`subspace+codec@48`, `subspace+codec@96`). The full
row is the baseline every ratio is against, so it always runs. `--subspace-keys "k = v; ..."`
adds `[model]` keys to the subspace rows' jobs (another kind of small boundary, say, scored on
the same links). `--bottleneck R` adds the rows `bottleneck` and `bottleneck+codec` (`[model]
boundary_bottleneck = R`: the learned bottleneck, swarm/model/bottleneck.py) unless `--rows`
names them; they need it.

The table's control (issue 65). A subspace row carries a fixed random token and position table
E (std `boundary_table`, 0.1 by default: 5x the plain embedding's initial 0.02) beside its
learned part, and a table alone may change the loss: `full+table` is the plain boundary with the
same E (the first `--rank`'s, each seed's, at the subspace rows' `boundary_table`). It is
trained as the plain model whose embedding starts at its seeded weights plus E (`[model]
init_from`, a checkpoint the bench writes per seed): with the bench's AdamW and no weight decay
that is the same training as a fixed E added to a learned embedding (the gradient of W + E is
the gradient of W, and Adam sees gradients only). Its bytes are the full row's.

Seeds (`--seeds`, at least 3 outside `--quick`): the unshaped pass trains every row once per
seed (`[training] seed` 0, 1, ...: each its own initialisation, data order and table); the
shaped pass, which only times steps, runs seed 0. A row's equal-step loss is the mean of its
last 4 evaluations (each on 32 validation microbatches), and the score's is the mean over the
seeds, printed with the spread of the seeds; a row's penalty is taken seed by seed against the
full row of the same seed (paired), printed as its mean and range. The curve steps to the
target are read off is the seeds' mean curve.

1. Unshaped. Each row trains `--max-steps` steps on a fresh swarm in the namespaces, links not
   shaped (a plain pfifo), evaluating every `--eval-every` steps: its validation curve, its
   steady step time (below), and its bytes per token each way per boundary, read from every
   stage server's `swarm_stage_boundary_{bytes,tokens}_sent_total` at the end (forward at
   boundary k|k+1 is stage k's, backward stage k+1's).
2. The shaping. The link rate is the full row's busiest host's boundary bytes per training
   step (its outputs forward plus its input gradient backward: its bytes per token each way
   times the tokens a step trains, so the evaluations' forwards are left out) over `--factor`
   x its unshaped step time:
   at that rate the full boundary's traffic needs `--factor` x what the link carries while the
   stages compute at their unshaped rate. Every host's link gets it both ways (tc tbf on both
   ends of its veth, as bench/wan.py shapes). The full row sends float32; a bf16 boundary, the
   unit the issue counts bytes in, is half of it: `--factor 32,64` (the default) shapes the
   links 32x under the full row's need and again 64x (32x under a bf16 boundary's), each a
   shaped pass and a score of its own against the one unshaped pass.
3. Shaped. Each row again on a fresh swarm over the shaped links, only until its step time is
   steady (no evaluation).

The target validation loss is the full row's unshaped one at `--target-step` (default half of
`--max-steps`: one every row should reach). A row's steps are the first evaluated step at or
below it ("-": not reached by `--max-steps`). The steady step time is read off the times the
trainer's `--log` lines appear (polled), after 2 warm-up steps, in windows of 4 steps: the mean
of the first three consecutive windows within `--agree` of their mean, else, after
`--max-windows`, of the last three ("not steady"); bench/time_to_loss.py's rule. An unshaped
run's windows are those of its first `--max-windows` windows that hold no evaluation step.

Printed, for each factor: both tables (shaped, unshaped) with bytes/token each way (and x fewer than
bf16, the issue's unit: 2 x d_model), the equal-step validation loss (its seeds' spread) and its
paired penalty against the full row's and the `full+table` row's, the steady step time, steps to
the target, T, and T against the full row's and the same-codec full row's (`full` for a row
without a codec, `full+<codec>` for one with it); then the targets, PASS or FAIL: at the T-best
shaped row, T <= 0.25 x the full row's, >= 32x fewer bytes per token than bf16 both ways, the
equal-step loss within 3% of the full row's and (where it ran) of the `full+table` row's, and its
shaped throughput >= 0.8 x its unshaped one. The exit status is 1 when any target fails (or the
run does), 0 when every one passes.

`--quick` is a smoke run of the bench itself (the `small` workload, d_model 64, 16 steps evaluated
every 8, windows of 2 steps, links at most 4x under the need, one seed unless `--seeds`): it
checks the plumbing, not the score, though it is judged (and exits) the same way.

Needs root, `ip`, `tc` and `curl`. Namespaces are `swbnd-<pid>-<host>`; leftovers of a run that
died are removed first, everything on exit.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import time_to_loss as ttl  # noqa: E402
import wan  # noqa: E402  (puts the repository root on sys.path too)

from swarm.errors import ConfigError  # noqa: E402
from swarm.job.config import parse_job  # noqa: E402
from swarm.job.small_boundary import DEFAULT_TABLE  # noqa: E402
from swarm.local.netns import Network, Proc, remove_leftovers  # noqa: E402

ROOT = wan.ROOT
PREFIX = "swbnd-"  # its own: a run removes its prefix's namespaces whose maker is gone
STAGES = 4
METRICS_PORT = 9100
WINDOW = 4  # steps per window of the steady step time
BASE = "full"
TABLE = "full+table"  # the control of the subspace rows' fixed table (issue 65)
KINDS = ("full", "subspace", "bottleneck")
# The issue's targets, at the T-best shaped row.
T_RATIO, BF16_FEWER, LOSS_PENALTY, THROUGHPUT = 0.25, 32.0, 0.03, 0.8
EVAL_MICROBATCHES = 32  # each evaluation's validation microbatches (issue 65: >= 32)
LAST_EVALS = 4  # the equal-step loss: the mean of a run's last 4 evaluations
MIN_SEEDS = 3  # outside --quick: fewer seeds cannot tell a 3% penalty from the noise

WORKLOADS: dict[str, dict[str, int]] = {
    "d320": dict(d_model=320, n_heads=5, seq_len=32, microbatch_size=8, target_batch_size=32),
    "small": dict(d_model=64, n_heads=4, seq_len=32, microbatch_size=8, target_batch_size=32),
}


@dataclass(frozen=True)
class Row:
    name: str  # as given: full, full+hadamard3, subspace, subspace+codec ...
    subspace: bool
    codec: str  # "none" or the wire codec
    bottleneck: bool = False  # `--bottleneck`: [model] boundary_bottleneck
    rank: int = 0  # a subspace row's boundary_rank
    table: bool = False  # `full+table`: the plain boundary with the subspace rows' fixed table


def parse_ranks(text: str) -> list[int]:
    """`--rank`: one boundary_rank or several, comma-separated (`48,96`), each >= 1, no repeats."""
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rank {text!r}: integers, comma-separated") from None
    if not ranks or min(ranks) < 1 or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"--rank {text!r}: distinct ranks >= 1")
    return ranks


def parse_rows(text: str, codec: str, ranks: tuple[int, ...] = (48,)) -> list[Row]:
    """The rows, full first; each subspace row once per rank, named `<row>@<rank>` when there
    are several ranks."""
    rows: list[Row] = []
    for name in [n.strip() for n in text.split(",") if n.strip()]:
        if name == TABLE:
            rows.append(Row(name, False, "none", table=True))
            continue
        kind, _, suffix = name.partition("+")
        if kind not in KINDS or (suffix and suffix not in ("codec", codec)):
            raise argparse.ArgumentTypeError(
                f"row {name!r}: use full, {TABLE}, subspace or bottleneck, optionally +codec "
                f"(+{codec})"
            )
        wire = codec if suffix else "none"
        if kind != "subspace":
            rows.append(Row(name, False, wire, kind == "bottleneck"))
            continue
        for rank in ranks:
            label = f"{name}@{rank}" if len(ranks) > 1 else name
            rows.append(Row(label, True, wire, rank=rank))
    if not rows or rows[0].name != BASE:
        rows = [Row(BASE, False, "none"), *(r for r in rows if r.name != BASE)]
    return rows


def parse_factors(text: str, at_most: float = math.inf) -> list[float]:
    """`--factor`: the link factors, each > 1, capped at `at_most` (`--quick`), distinct."""
    try:
        factors = [min(float(f), at_most) for f in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--factor {text!r}: numbers, comma-separated") from None
    if any(not f > 1 for f in factors):
        raise argparse.ArgumentTypeError(f"--factor {text!r}: each > 1 (a link under the need)")
    return list(dict.fromkeys(factors))


def job_text(
    args: argparse.Namespace,
    row: Row,
    steps: int,
    eval_every: int,
    seed: int = 0,
    init_from: Path | None = None,
) -> str:
    """`row`'s job; `init_from`: the `full+table` row's checkpoint of its seed (`table_start`;
    None where the row is checked, before any is written: it is then the full row's job)."""
    p = WORKLOADS[args.workload]
    keys = [f"boundary_rank = {row.rank}", *args.subspace_keys.split(";")] if row.subspace else []
    keys += [f"boundary_bottleneck = {args.bottleneck}"] if row.bottleneck else []
    keys += [f'init_from = "{init_from}"'] if row.table and init_from is not None else []
    rank = "".join(f"{k.strip()}\n" for k in keys if k.strip())
    return f"""name = "boundary-{args.workload}"
[model]
kind = "gpt"
vocab_size = 256
d_model = {p["d_model"]}
n_layers = {STAGES}
n_heads = {p["n_heads"]}
seq_len = {p["seq_len"]}
{rank}[data]
kind = "text"
path = "{ttl.CORPUS}"
val_fraction = 0.1
[training]
stages = {STAGES}
microbatch_size = {p["microbatch_size"]}
target_batch_size = {p["target_batch_size"]}
steps = {steps}
seed = {seed}
dtype = "float32"
checkpoint_every = 0
eval_every = {eval_every}
eval_microbatches = {EVAL_MICROBATCHES}
[optimizer]
kind = "adamw"
lr = 1e-3
[compression]
wire = "{row.codec}"
[runtime]
data_plane = "push"
"""


def table_of(args: argparse.Namespace) -> float:
    """The subspace rows' `boundary_table`: as `--subspace-keys` sets it, else the default."""
    for key in args.subspace_keys.split(";"):
        name, _, value = key.partition("=")
        if name.strip() == "boundary_table":
            return float(value)
    return DEFAULT_TABLE


def table_start(args: argparse.Namespace, seed: int, out: Path) -> Path:
    """The `full+table` row's start for `seed`: the plain model's seeded weights with the
    subspace rows' fixed table E (the first rank's, the same bits as theirs) added to the
    embedding's token and position rows, written as a checkpoint in float64 (`init_from` reads
    it in float64 before the job's cast, as a seeded start is). Under AdamW without weight decay
    a learned W starting at W0 + E trains as W0 + (a fixed E) would: same gradients, same steps."""
    import torch

    from swarm.model.hf import write_hf
    from swarm.model.subspace import Subspace
    from swarm.model.transformer import build_model

    plain = Row(BASE, False, "none")
    job = parse_job(job_text(args, plain, args.max_steps, args.eval_every, seed), ROOT, "table")
    if job.optimizer.kind != "adamw" or job.optimizer.weight_decay:
        raise RuntimeError("full+table needs AdamW without weight decay (it shifts the start)")
    job = replace(job, training=replace(job.training, dtype="float64"))
    cfg = job.model
    table = Subspace(cfg.d_model, args.ranks[0], cfg.vocab_size, cfg.seq_len, seed, table_of(args))
    state = build_model(job).state_dict()
    for name, fixed in (("tok", table.tokens), ("pos", table.positions)):
        key = f"layers.0.{name}.weight"
        state[key] = state[key] + fixed[: state[key].shape[0]]
    return write_hf(out, state, cfg, torch.float64)


# ---------------------------------------------------------------------------------------------
# One swarm in the namespaces


def hosts() -> list[str]:
    return [f"stage{k}" for k in range(STAGES)]


def addresses() -> dict[str, str]:
    return {
        wan.TRAINER: f"{wan.SUBNET}.10",
        **{h: f"{wan.SUBNET}.{11 + k}" for k, h in enumerate(hosts())},
    }


def launch(net: Network, job: Path, label: str, work: Path, procs: list[Proc]) -> tuple[Path, Proc]:
    """Fresh stage servers (one per stage, /metrics on) and the trainer with its --log, appended
    to `procs`."""
    address = addresses()
    start_at = len(procs)
    for k, host in enumerate(hosts()):
        flags = f"--stage {k} --host {address[host]} --port {wan.PORT} --device cpu --threads 1"
        flags += f" --metrics-port {METRICS_PORT} --insecure-no-token"  # namespaces here alone
        argv = wan.swarm_cmd("stage-server", "--job", str(job), *flags.split())
        procs.append(wan.start(net, host, f"{label}-{host}", argv, work))
    deadline = time.monotonic() + wan.READY_TIMEOUT_S
    for proc in procs[start_at:]:
        proc.wait_ready(deadline)
    log = work / f"{label}-steps.jsonl"
    servers = ",".join(f"{address[h]}:{wan.PORT}" for h in hosts())
    argv = wan.swarm_cmd("trainer", "--job", str(job), "--threads", "1", "--log", str(log))
    trainer = wan.start(
        net, wan.TRAINER, f"{label}-trainer", [*argv, "--stage-servers", servers], work
    )
    procs.append(trainer)
    return log, trainer


def boundary_counts(net: Network) -> list[dict[str, float]]:
    """Per stage: its boundary bytes and tokens sent each way (`forward_bytes`, ...), read off
    its /metrics inside its namespace."""
    address, out = addresses(), []
    for host in hosts():
        url = f"http://{address[host]}:{METRICS_PORT}/metrics"
        cmd = ["ip", "netns", "exec", net.ns[host], "curl", "-s", "--max-time", "10", url]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        got = dict.fromkeys(
            ("forward_bytes", "forward_tokens", "backward_bytes", "backward_tokens"), 0.0
        )
        for line in text.splitlines():
            for what in ("bytes", "tokens"):
                if line.startswith(f"swarm_stage_boundary_{what}_sent_total{{"):
                    way = "forward" if 'direction="forward"' in line else "backward"
                    got[f"{way}_{what}"] += float(line.rsplit(None, 1)[1])
        out.append(got)
    return out


def per_token(counts: list[dict[str, float]]) -> dict[str, Any]:
    """Bytes per token at each boundary k|k+1, each way, and their mean over the boundaries."""
    forward = [c["forward_bytes"] / c["forward_tokens"] for c in counts[:-1] if c["forward_tokens"]]
    backward = [
        c["backward_bytes"] / c["backward_tokens"] for c in counts[1:] if c["backward_tokens"]
    ]
    return {
        "forward": sum(forward) / len(forward) if forward else math.nan,
        "backward": sum(backward) / len(backward) if backward else math.nan,
        "by_boundary": {"forward": forward, "backward": backward},
    }


def step_times(
    count: Any, check: Any, args: argparse.Namespace, until_end: Any = None
) -> list[float]:
    """When each step's log line appeared, polled, until `until_end()` says the job ended (an
    unshaped run: every step), or until the windows are steady (a shaped run)."""
    arrived: list[float] = []
    deadline = time.monotonic() + args.timeout
    while True:
        done, now = count(), time.monotonic()
        arrived += [now] * (done - len(arrived))
        if until_end is not None and until_end():
            return arrived
        if until_end is None:
            periods = windows(arrived, args.window)
            if len(periods) >= args.max_windows or ttl.steady(periods, args.agree):
                return arrived
        check()
        if now > deadline:
            raise TimeoutError(f"{len(arrived)} steps in {args.timeout:.0f}s")
        time.sleep(0.01)


def windows(arrived: list[float], w: int, skip: frozenset[int] = frozenset()) -> list[float]:
    """Mean step time of each window of `w` steps after the warm-up (windows holding a step of
    `skip` left out)."""
    out = []
    for lo in range(ttl.WARMUP_STEPS, len(arrived) - w + 1, w):
        if not any(lo <= s < lo + w for s in skip):
            out.append((arrived[lo + w - 1] - arrived[lo - 1]) / w)
    return out


def steady_time(periods: list[float], args: argparse.Namespace) -> tuple[float, bool]:
    periods = periods[: args.max_windows]
    if len(periods) < 3:
        raise RuntimeError(f"too few windows for a steady step time: {periods}")
    found = ttl.steady(periods, args.agree)
    first, is_steady = found if found is not None else (len(periods) - 3, False)
    return sum(periods[first : first + 3]) / 3, is_steady


def run_row(
    net: Network,
    row: Row,
    args: argparse.Namespace,
    work: Path,
    procs: list[Proc],
    shaped: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """One row of one seed on a fresh swarm: unshaped, trained to `--max-steps` with its
    evaluations; shaped, until steady. Every process killed after."""
    # a shaped run's files are named with its factor: each factor's pass has its own
    label = f"{f'shaped{args.factor:g}x' if shaped else 'unshaped'}-{row.name.replace('+', '_')}"
    label += f"-seed{seed}"
    steps = (
        ttl.WARMUP_STEPS + (args.max_windows + 1) * args.window + 2 if shaped else args.max_steps
    )
    start = table_start(args, seed, work / f"{label}-start") if row.table else None
    job = work / f"{label}.toml"
    job.write_text(job_text(args, row, steps, 0 if shaped else args.eval_every, seed, start))
    start_at = len(procs)
    try:
        log, trainer = launch(net, job, label, work, procs)
        arrived = step_times(
            lambda: min(wan.count_lines(log), steps),  # the final evaluation's line aside
            # unshaped, the trainer ends with the job (its exit code is checked below)
            lambda: ttl.check_alive(
                [p for p in procs[start_at:] if shaped or p is not trainer], label
            ),
            args,
            None if shaped else (lambda: trainer.popen.poll() is not None),
        )
        if not shaped and trainer.popen.returncode != 0:
            raise RuntimeError(f"{label}: the trainer failed:\n{trainer.log()[-3000:]}")
        counts = boundary_counts(net)
    finally:
        for proc in procs[start_at:]:
            proc.kill()
        del procs[start_at:]
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    skip = frozenset() if shaped else frozenset(s for s, _ in evals)
    step_s, is_steady = steady_time(windows(arrived, args.window, skip), args)
    return {
        "row": row.name,
        "seed": seed,
        "step_seconds": step_s,
        "steady": is_steady,
        "evals": evals,
        "bytes_per_token": per_token(counts),
        "boundary_counts": counts,
    }


def equal_step_loss(evals: list[tuple[int, float]]) -> float:
    """One run's equal-step validation loss: the mean of its last `LAST_EVALS` evaluations (one
    evaluation is one draw of the noise the issue measured above the 3% target)."""
    last = [loss for _, loss in evals[-LAST_EVALS:]]
    return sum(last) / len(last) if last else math.nan


def over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's unshaped runs, one per seed (the same evaluation steps), as one: the seeds' mean
    curve (which steps to the target are read off), each seed's equal-step loss, the mean step
    time, and the first seed's bytes (the bytes do not depend on the seed)."""
    steps = [s for s, _ in runs[0]["evals"]]
    if any([s for s, _ in r["evals"]] != steps for r in runs):
        raise RuntimeError(f"row {runs[0]['row']}: its seeds evaluated at different steps")
    curve = [(s, sum(r["evals"][i][1] for r in runs) / len(runs)) for i, s in enumerate(steps)]
    return {
        **runs[0],
        "seeds": [r["seed"] for r in runs],
        "evals": curve,
        "equal_step": [equal_step_loss(r["evals"]) for r in runs],
        "step_seconds": sum(r["step_seconds"] for r in runs) / len(runs),
        "steady": all(r["steady"] for r in runs),
        "by_seed": runs,
    }


# ---------------------------------------------------------------------------------------------
# The shaping, the target, the tables


def link_rate_bits(full: dict[str, Any], args: argparse.Namespace) -> float:
    """The rate (bits/s) at which the full row's busiest host's boundary traffic per training
    step needs `--factor` x its unshaped step time: each way, its bytes per token times the
    tokens a step trains. Not its bytes over the steps: its counters hold the evaluations'
    forwards too (32 validation microbatches each, as many tokens as 8 training steps'), which
    would make the link faster than `--factor` says (1.25x at the defaults)."""
    p = WORKLOADS[args.workload]
    tokens = p["target_batch_size"] * p["seq_len"]

    def need(c: dict[str, float]) -> float:
        ways = ("forward", "backward")
        return sum(c[f"{w}_bytes"] / c[f"{w}_tokens"] for w in ways if c[f"{w}_tokens"])

    per_step = tokens * max(need(c) for c in full["boundary_counts"])
    return 8 * per_step / (args.factor * full["step_seconds"])


def target(full: dict[str, Any], args: argparse.Namespace) -> tuple[int, float]:
    """The full row's unshaped validation loss at the last evaluated step at or before
    `--target-step`: (that step, the loss)."""
    at = [(s, v) for s, v in full["evals"] if s <= args.target_step]
    if not at:
        raise RuntimeError(f"the full row has no evaluation by step {args.target_step}")
    return at[-1]


def same_codec(name: str, rows: list[str]) -> str | None:
    """The full-boundary row with `name`'s codec: a small boundary's T against the boundary it
    shrinks with the codec's own share taken out (`full` for a row without a codec, the full
    row with the codec for one with it; one codec a run). A full row's is `full` itself."""
    if name == BASE:
        return None
    if name.startswith("full") or "+" not in name.split("@")[0]:
        return BASE
    return next((r for r in rows if r.startswith("full+") and r != TABLE), None)


def paired(losses: list[float], against: list[float]) -> dict[str, float]:
    """Each seed's equal-step loss against the other row's of the same seed: mean, min, max."""
    ratios = [a / b - 1 for a, b in zip(losses, against, strict=True)]
    return {"mean": sum(ratios) / len(ratios), "min": min(ratios), "max": max(ratios)}


def score(
    args: argparse.Namespace, unshaped: dict[str, dict[str, Any]], shaped: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Both tables' rows, the ratios against the full row, the same-codec row and the table's
    control, and the targets. `unshaped`: each row's runs over the seeds (`over_seeds`)."""
    target_step, target_loss = target(unshaped[BASE], args)
    bf16 = 2 * WORKLOADS[args.workload]["d_model"]  # bytes per token of a bf16 boundary
    names = list(unshaped)
    tables: dict[str, list[dict[str, Any]]] = {"shaped": [], "unshaped": []}
    for which, runs in (("shaped", shaped), ("unshaped", unshaped)):
        t_of: dict[str, float | None] = {}
        for name, r in runs.items():
            steps = ttl.steps_to(unshaped[name]["evals"], target_loss)
            t_of[name] = steps * r["step_seconds"] if steps is not None else None
        for name, r in runs.items():
            u, t = unshaped[name], t_of[name]
            codec_row = same_codec(name, names)
            losses = u["equal_step"]
            per = u["bytes_per_token"]
            tables[which].append(
                {
                    "row": name,
                    "forward_bytes_per_token": per["forward"],
                    "backward_bytes_per_token": per["backward"],
                    "fewer_than_bf16": min(bf16 / per["forward"], bf16 / per["backward"]),
                    "equal_step_loss": sum(losses) / len(losses),
                    "equal_step_spread": max(losses) - min(losses),
                    "equal_step_stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "vs_full": paired(losses, unshaped[BASE]["equal_step"]),
                    "vs_table": paired(losses, unshaped[TABLE]["equal_step"])
                    if TABLE in unshaped
                    else None,
                    "step_seconds": r["step_seconds"],
                    "steady": r["steady"],
                    "steps": ttl.steps_to(u["evals"], target_loss),
                    "T": t,
                    "T_vs_full": _ratio(t, t_of.get(BASE)),
                    "same_codec": codec_row,
                    "T_vs_same_codec": _ratio(t, t_of.get(codec_row)) if codec_row else None,
                    "throughput_vs_unshaped": u["step_seconds"] / r["step_seconds"]
                    if which == "shaped"
                    else None,
                }
            )
    reached = [r for r in tables["shaped"] if r["T"] is not None]
    best = min(reached, key=lambda r: r["T"]) if reached else None
    return {
        "workload": args.workload,
        "rows": names,
        "codec": args.codec,
        "rank": args.ranks[0] if len(args.ranks) == 1 else args.ranks,
        "bottleneck": args.bottleneck,
        "factor": args.factor,  # this score's
        "link_rate_bits": args.rate_bits,
        "seeds": unshaped[BASE]["seeds"],
        "target": {"step": target_step, "val_loss": target_loss},
        "equal_step": args.max_steps,
        "bf16_bytes_per_token": bf16,
        "tables": tables,
        "best": best["row"] if best else None,
        "goals": goals(best, TABLE in unshaped),
        "runs": {"unshaped": unshaped, "shaped": shaped},
    }


def goals(best: dict[str, Any] | None, table: bool) -> dict[str, bool]:
    """The targets at the T-best shaped row (`best`; None: no row reached the target, and every
    target fails). The loss is held to the full row and, where it ran, to the table's control:
    a penalty within 3% of the plain model that the table alone would have beaten by more is
    the table's gain, not the boundary's."""
    met = {
        "T <= 0.25 x full's T (shaped)": best is not None and (best["T_vs_full"] or 1) <= T_RATIO,
        ">= 32x fewer bytes/token than bf16, both ways": best is not None
        and best["fewer_than_bf16"] >= BF16_FEWER,
        "equal-step val loss within 3% of full's (mean over seeds, paired)": best is not None
        and best["vs_full"]["mean"] <= LOSS_PENALTY,
        "shaped throughput >= 0.8 x unshaped": best is not None
        and best["throughput_vs_unshaped"] >= THROUGHPUT,
    }
    if table:
        met[f"equal-step val loss within 3% of {TABLE}'s (the table's control)"] = (
            best is not None and best["vs_table"]["mean"] <= LOSS_PENALTY
        )
    return met


def failed(results: list[dict[str, Any]]) -> list[str]:
    """Every target that failed, in every factor's score: the bench exits 1 on any."""
    return [
        f"{r['factor']:g}x: {goal}" for r in results for goal, met in r["goals"].items() if not met
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt % value


def _pct(value: dict[str, float] | None) -> str:
    """A paired penalty: its mean over the seeds and their range."""
    if value is None:
        return "-"
    return f"{100 * value['mean']:+.2f}% [{100 * value['min']:+.2f}, {100 * value['max']:+.2f}]"


def print_report(r: dict[str, Any], out: IO[str]) -> None:
    t = r["target"]
    ranks = r["rank"] if isinstance(r["rank"], list) else [r["rank"]]
    print(
        f"workload {r['workload']}, {STAGES} stages on {STAGES} hosts, push plane; codec "
        f"{r['codec']}, rank {','.join(map(str, ranks))}; "
        f"links {r['link_rate_bits'] / 1e6:.3f} Mbit/s each way "
        f"({r['factor']:g}x under the full boundary's unshaped need)",
        file=out,
    )
    print(
        f"target validation loss {t['val_loss']:.4f}: the full row's unshaped at step "
        f"{t['step']} (its seeds' mean curve); equal-step loss: the mean of the last "
        f"{LAST_EVALS} evaluations ({EVAL_MICROBATCHES} validation microbatches each) to step "
        f"{r['equal_step']}, over seeds {','.join(map(str, r['seeds']))} (spread: max - min); "
        "penalties paired by seed, mean [min, max]",
        file=out,
    )
    head = (
        "| row | fwd B/token | bwd B/token | x fewer than bf16 | val loss | spread | vs full | "
        f"vs {TABLE} | s/step | steps | T (s) | T / T_full | T / T_same-codec | "
        "shaped / unshaped speed |"
    )
    for which in ("shaped", "unshaped"):
        print(f"\n{which}:\n{head}\n|{'---|' * 14}", file=out)
        for row in r["tables"][which]:
            codec = row["same_codec"]
            print(
                f"| {row['row']} | {_num(row['forward_bytes_per_token'], '%.1f')} | "
                f"{_num(row['backward_bytes_per_token'], '%.1f')} | "
                f"{_num(row['fewer_than_bf16'], '%.1f')} | {_num(row['equal_step_loss'], '%.4f')}"
                f" | {_num(row['equal_step_spread'], '%.4f')} | {_pct(row['vs_full'])} | "
                f"{_pct(row['vs_table'])} | {row['step_seconds']:.3f}"
                f"{'' if row['steady'] else ' (not steady)'} | {_num(row['steps'], '%d')} | "
                f"{_num(row['T'], '%.0f')} | {_num(row['T_vs_full'], '%.3f')} | "
                f"{_num(row['T_vs_same_codec'], '%.3f')}{f' ({codec})' if codec else ''} | "
                f"{_num(row['throughput_vs_unshaped'], '%.2f')} |",
                file=out,
            )
    print(f"\nT-best shaped row: {r['best'] or 'none reached the target'}", file=out)
    for goal, met in r["goals"].items():
        print(f"  {'PASS' if met else 'FAIL'}  {goal}", file=out)


# ---------------------------------------------------------------------------------------------
# The run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        default=f"full,{TABLE},full+codec,subspace,subspace+codec",
        help="comma-separated (full always runs); the subspace rows need [model] boundary_rank",
    )
    parser.add_argument("--codec", default="hadamard3", help="the +codec rows' wire codec")
    parser.add_argument(
        "--rank",
        default="48",
        help="the subspace rows' boundary_rank (48: >= 32x with hadamard3); several, "
        "comma-separated (48,96), score each subspace row at each",
    )
    parser.add_argument(
        "--subspace-keys", default="", help='more [model] keys of the subspace rows: "k = v; ..."'
    )
    parser.add_argument(
        "--bottleneck", type=int, default=0, help="the bottleneck rows' boundary_bottleneck"
    )
    parser.add_argument(
        "--factor",
        default="32,64",
        help="full traffic / link rate; several, comma-separated: a shaped pass and a score each",
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="d320")
    parser.add_argument("--max-steps", type=int, default=480)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--target-step", type=int, help="default: half of --max-steps")
    parser.add_argument("--agree", type=float, default=0.05, help="steady: windows within this")
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    parser.add_argument(
        "--seeds", type=int, help=f"seeds of the unshaped pass (default and least {MIN_SEEDS})"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of the bench")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.window = WINDOW
    if args.quick:
        args.workload, args.max_steps, args.eval_every, args.window = "small", 16, 8, 2
        args.max_windows = 3
    if args.seeds is None:
        args.seeds = 1 if args.quick else MIN_SEEDS
    if args.seeds < (1 if args.quick else MIN_SEEDS):
        parser.error(f"--seeds {args.seeds}: at least {MIN_SEEDS} (1 with --quick, a smoke run)")
    if args.target_step is None:
        args.target_step = args.max_steps // 2
    try:
        named = any(r.partition("+")[0].strip() == "bottleneck" for r in args.rows.split(","))
        more = ",bottleneck,bottleneck+codec" if args.bottleneck and not named else ""
        args.ranks = parse_ranks(args.rank)
        args.factors = parse_factors(args.factor, 4.0 if args.quick else math.inf)
        args.row_list = parse_rows(args.rows + more, args.codec, tuple(args.ranks))
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    return args


def check(args: argparse.Namespace) -> str | None:
    """Why this cannot run, or None."""
    if not shutil.which("ip") or not shutil.which("tc") or not shutil.which("curl"):
        return "needs ip, tc (iproute2) and curl on PATH"
    from swarm.local.netns import available

    why = available()
    if why:
        return why
    if args.max_steps < args.eval_every or args.eval_every < 1:
        return "--max-steps must be at least --eval-every, which must be >= 1"
    for row in args.row_list:
        if row.bottleneck and args.bottleneck < 1:  # 0 would be a silent full boundary
            return f"row {row.name}: the bottleneck rows need --bottleneck R (R >= 1)"
        try:
            parse_job(job_text(args, row, args.max_steps, args.eval_every), ROOT, "boundary")
        except ConfigError as e:
            hint = " (boundary_rank needs the subspace boundary: --rows full,full+codec)"
            return f"row {row.name}: the job would not load: {e}" + (hint * row.subspace)
    return None


def _bench_alive(pid: int) -> bool:
    try:
        return b"boundary.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> int:
    args = parse_args()
    problem = check(args)
    if problem:
        say(f"bench/boundary.py: {problem}")
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="swarm-boundary-"))
    net = Network(PREFIX, addresses())
    procs: list[Proc] = []
    results: list[dict[str, Any]] = []  # a score per factor
    status = 1
    try:
        removed = remove_leftovers(PREFIX, _bench_alive)
        if removed:
            say(f"removed leftover namespaces: {', '.join(removed)}")
        net.create()
        net.shape(None)
        unshaped: dict[str, dict[str, Any]] = {}
        for row in args.row_list:
            runs = []
            for seed in range(args.seeds):
                say(
                    f"unshaped {row.name}, seed {seed}: {args.max_steps} steps, evaluated "
                    f"every {args.eval_every}"
                )
                u = run_row(net, row, args, work, procs, shaped=False, seed=seed)
                runs.append(u)
                say(
                    f"  {u['step_seconds']:.3f} s/step, bytes/token "
                    f"{u['bytes_per_token']['forward']:.1f} / "
                    f"{u['bytes_per_token']['backward']:.1f}, equal-step val loss "
                    f"{equal_step_loss(u['evals']):.4f}"
                )
            unshaped[row.name] = over_seeds(runs)
        for factor in args.factors:
            args.factor = factor
            args.rate_bits = link_rate_bits(unshaped[BASE], args)
            net.shape(args.rate_bits)
            say(f"links shaped to {args.rate_bits / 1e6:.3f} Mbit/s each way ({factor:g}x)")
            shaped: dict[str, dict[str, Any]] = {}
            for row in args.row_list:
                say(f"shaped {row.name} ...")
                shaped[row.name] = run_row(net, row, args, work, procs, shaped=True)
                say(f"  {shaped[row.name]['step_seconds']:.3f} s/step")
            results.append(score(args, unshaped, shaped))
        status = 0
    except KeyboardInterrupt:
        say("interrupted")
        status = 130
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        say(f"bench/boundary.py: {e}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in procs:
            proc.kill()
        net.destroy()
        if status == 0 and not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"logs in {work}")
    if status == 0:
        if args.json:
            print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
        for i, result in enumerate(results if not args.json else []):
            print("\n" * bool(i), end="")
            print_report(result, sys.stdout)
        missed = failed(results)
        for goal in missed:
            say(f"FAIL {goal}")
        status = 1 if missed else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
