"""A joining peer measures its own samples/s on each stage's compute (forward + backward of one
microbatch), so the scheduler can place it where it raises the bottleneck most. Results are cached
per model shape, stage, microbatch size, dtype, precision, device model and torch version, since
building and timing every stage of a large model is not free.

Peers on one machine measure one at a time (a lock beside the cache, one per device): several
peers that start together would otherwise time their stages while the others time theirs, and
on a small machine that made one stage look 4x slower than the rest to all of them (placement
then put four of six peers there). The first to take the lock measures; the others then find
its figures in the cache, so co-located peers of one device agree exactly; the log line that
shows them says so, with the cache's path (delete it to measure again).

It times a replica's own compute (`StageRuntime`), so it lives with the replica; before it builds
anything it asks the peer whether the job's stages fit (`stage_server.peer.fits.check_fits`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from stage_server.peer.fits import check_fits
from stage_server.peer.identity import cache_dir
from stage_server.peer.limits import PeerLimits
from stage_server.replica.runtime import StageRuntime
from swarm.device.compute_clock import ComputeClock, clock_for
from swarm.device.facts import DeviceFacts
from swarm.job.config import JobConfig
from swarm.model.transformer import boundary_width, layer_costs, partition
from swarm.ops.file_locks import taken_now
from swarm.wire.crossing import Crossing

__all__ = ["cache_path", "device_model", "measure_job", "measure_stage"]

log = logging.getLogger(__name__)

# How long a peer waits for another's measurement on its machine (seconds; a measurement is a
# few runs of each stage), and how often it looks again meanwhile.
LOCK_WAIT_S = 300.0
LOCK_POLL_S = 0.1
# Timed runs after one warm-up: at least _REPEATS, and more until they add up to _MIN_TIMED_S
# (at most _MAX_REPEATS), so a small stage is timed over many runs, not three of a millisecond.
_REPEATS, _MIN_TIMED_S, _MAX_REPEATS = 3, 0.1, 100


# Stages' figures a machine's cache keeps, those used last (~400 bytes each): the whole file is
# read and written at each take-up, and kept a key per model shape ever measured.
KEPT_MEASURES = 1024


def cache_path() -> Path:
    """The machine's figures: a file in the peers' cache directory, shared by all of them."""
    return cache_dir() / "throughput.json"


def device_model(device: torch.device) -> str:
    """What `device` is, for the cache key: the GPU's name (two peers on two cards of one model
    share their figures; a card swapped for another measures anew), or the host's CPU."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu {_cpu_model()}"
    return device.type


def _cpu_model() -> str:
    try:  # Linux names the model; elsewhere the architecture is what there is
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(job: JobConfig, stage: int, device: torch.device) -> str:
    """What a stage's speed depends on: its layers and shape, the microbatch, the dtype and
    precision it computes in (bf16-mixed autocasts an fp32 job's matmuls; `tf32` runs float32
    matmuls on tensor cores), the device's model and the torch build."""
    layers = list(partition(layer_costs(job.model), job.training.stages)[stage])
    return json.dumps(
        [
            job.to_dict()["model"],
            layers[0],
            layers[-1],
            job.training.microbatch_size,
            job.training.dtype,
            job.training.precision,
            job.training.tf32,
            device_model(device),
            torch.__version__,
        ],
        sort_keys=True,
    )


def measure_stage(
    job: JobConfig, stage: int, device: torch.device, clock: ComputeClock | None = None
) -> float:
    """Samples/s of forward + backward of one microbatch through `stage` on `device`, each run
    timed by `clock` (the device's) to the end of its work on the device."""
    clock = clock or clock_for(device)
    rt = StageRuntime(job, stage, device)
    b, t, cfg = job.training.microbatch_size, job.model.seq_len, job.model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    if rt.is_first:
        inputs = tokens
    else:
        inputs = torch.randn(b, t, boundary_width(cfg), generator=gen).to(rt.dtype)
    given = Crossing(inputs, tokens)  # the token ids beside: a subspace boundary's need them
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    times: list[float] = []
    while len(times) <= _REPEATS or (sum(times[1:]) < _MIN_TIMED_S and len(times) <= _MAX_REPEATS):
        i = len(times)
        start = clock.now()
        if rt.is_last:
            rt.forward_backward(0, i, given, targets, accumulate=False)
        else:
            out = rt.forward(0, i, given)
            rt.backward(0, i, given, torch.ones_like(out), accumulate=False)
        clock.settle()
        times.append(clock.now() - start)
    # The fastest run, not the median: other processes on the machine (peers that measure at the
    # same moment, a test suite) only ever add time, and placement compares stages measured at
    # different moments, so the figure must not depend on what else ran then.
    return b / max(min(times[1:]), 1e-9)


@contextlib.contextmanager
def _measuring_alone(path: Path, device: torch.device) -> Iterator[None]:
    """Hold the machine's measuring lock for `device` (blocking while another peer measures);
    without a writable cache directory, measure without it."""
    lock = path.with_name(f"{path.stem}.{device.type}{device.index or 0}.lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("cannot take the measuring lock %s: %s; measuring anyway", lock, e)
        yield
        return
    try:
        _locked(fd, lock)
        yield
    finally:
        os.close(fd)


def _locked(fd: int, lock: Path) -> None:
    """Take the measuring lock on `fd` (released with the descriptor, even if this process
    dies), waiting at most LOCK_WAIT_S for the peer that holds it, said at once: a measurement
    that never ends elsewhere (hung, stopped in a debugger) would hold this one for good, and a
    stop with it. Past the bound it measures without the lock (the figures only noisier)."""
    deadline, said = time.monotonic() + LOCK_WAIT_S, False
    while not taken_now(fd):
        if not said:
            log.warning(
                "another stage server of this machine is measuring (%s): waiting up to %.0f s",
                lock,
                LOCK_WAIT_S,
            )
            said = True
        if time.monotonic() >= deadline:
            log.warning("the measuring lock %s still held: measuring without it", lock)
            return
        time.sleep(LOCK_POLL_S)


def measure_job(
    job: JobConfig,
    device: torch.device,
    throttle: float = 1.0,
    limits: PeerLimits | None = None,
    *,
    memory_bytes: int | None = None,
    facts: DeviceFacts | None = None,
) -> dict[int, float]:
    """Samples/s per stage, divided by `throttle`; cached on disk, measured by one peer of a
    machine at a time. A job with a stage whose footprint on a peer of `limits` is over
    `memory_bytes` (default: the device's free memory) is refused first (`check_fits`)."""
    check_fits(job, device, memory_bytes, limits=limits, facts=facts)
    path = cache_path()
    with _measuring_alone(path, device):
        try:
            cache: dict[str, float] = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        result, measured = {}, False
        for stage in range(job.training.stages):
            key = _key(job, stage, device)
            if key not in cache:
                cache[key] = measure_stage(job, stage, device)
                measured = True
                log.debug("measured stage %d on %s: %.1f samples/s", stage, device, cache[key])
            result[stage] = cache[key] / max(throttle, 1.0)
        _say(job, device, cache, path, measured, throttle)
        if measured:
            for stage in range(job.training.stages):  # used now: the last to go
                key = _key(job, stage, device)
                cache[key] = cache.pop(key)
            for old in list(cache)[:-KEPT_MEASURES]:  # a key per shape ever measured stayed
                del cache[old]
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(cache))
                tmp.replace(path)  # atomic: readers without the lock see the old or the new
            except OSError as e:
                log.warning("cannot write the throughput cache %s: %s", path, e)
    return result


def _say(
    job: JobConfig,
    device: torch.device,
    cache: dict[str, float],
    path: Path,
    measured: bool,
    throttle: float,
) -> None:
    """The figures, and that they are the machine's: every peer of it on `device` shows them."""
    figures = {s: round(cache[_key(job, s, device)], 1) for s in range(job.training.stages)}
    log.info(
        "%s samples/s per stage on %s: %s (shared by the peers on this machine, cached %s)%s",
        "measured" if measured else "read",
        device,
        figures,
        path,
        f"; --throttle {throttle} divides them" if throttle > 1.0 else "",
    )
