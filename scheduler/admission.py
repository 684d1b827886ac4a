"""What a submitted job must fit before the scheduler stores it: no more unfinished jobs of its
submitter than `--max-jobs-per-submitter`, no faster than `--max-submits-per-minute`
(`scheduler.submit_rate`), and a largest stage that some peer could hold.

A stage's state is counted on the meta device (`swarm.model.sizes`) and compared with the
scheduler's `--max-stage-bytes`, and with one microbatch's activations on top
(`swarm.model.footprint`) with the largest memory a present peer announced: a job of
3.3 T parameters is refused here, naming its sizes, instead of idle peers building it layer by
layer until the kernel kills them (each peer checks again before it measures:
`stage_server.peer.fits`). With neither bound (no flag, no peer that said its memory yet) the
size is not refused here; the peers' own check still holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.callers import shown
from scheduler.store import JobStore
from scheduler.submit_rate import MAX_SUBMITS_PER_MINUTE, SubmitRate
from swarm.errors import ConfigError, ResourceExhausted
from swarm.job.config import JobConfig
from swarm.model.footprint import stage_footprints
from swarm.model.sizes import format_bytes, stage_parameters, stage_state_bytes

__all__ = ["MAX_JOBS_PER_SUBMITTER", "MAX_SUBMITS_PER_MINUTE", "Admission", "PeerMemory"]

MAX_JOBS_PER_SUBMITTER = 8  # unfinished jobs (queued, placing, running, stalled) per submitter

PeerMemory = Callable[[], tuple[int, str]]
"""The largest memory (bytes) a present peer announced, and that peer's id; (0, "") when none
said."""


def _none_said() -> tuple[int, str]:
    return 0, ""


@dataclass(frozen=True)
class Admission:
    max_jobs_per_submitter: int | None = MAX_JOBS_PER_SUBMITTER  # None: no cap
    max_stage_bytes: int | None = None  # the operator's bound on one stage's state (None: none)
    peer_memory: PeerMemory = _none_said
    max_submits_per_minute: float | None = MAX_SUBMITS_PER_MINUTE  # per submitter (None: any)
    rate: SubmitRate | None = field(init=False, default=None, compare=False)  # its buckets

    def __post_init__(self) -> None:
        if self.max_jobs_per_submitter is not None and self.max_jobs_per_submitter < 1:
            raise ConfigError(
                f"--max-jobs-per-submitter {self.max_jobs_per_submitter} is not allowed; use an "
                "integer >= 1"
            )
        if self.max_stage_bytes is not None and self.max_stage_bytes < 1:
            raise ConfigError(f"--max-stage-bytes {self.max_stage_bytes}: use an integer >= 1")
        if self.max_submits_per_minute is not None:
            # A minute's worth at once (or a whole queue, if more): a submitter refused at its
            # cap, who cancels one and submits again, is not refused for the rate.
            cap = self.max_jobs_per_submitter or MAX_JOBS_PER_SUBMITTER
            burst = max(cap, math.ceil(self.max_submits_per_minute))
            rate = SubmitRate(self.max_submits_per_minute, burst)
            object.__setattr__(self, "rate", rate)  # frozen: the settings, not the buckets

    def check_submit(self, store: JobStore, submitter: str) -> None:
        """`check_count`, then one of `submitter`'s submits (`SubmitRate.take`): before any
        work for the job, so a refused or failing submit costs its place in the rate too."""
        self.check_count(store, submitter)
        if self.rate is not None:
            self.rate.take(submitter)

    def check_count(self, store: JobStore, submitter: str) -> None:
        """ResourceExhausted when `submitter` already has the unfinished jobs it may have."""
        cap = self.max_jobs_per_submitter
        if cap is None:
            return
        have = store.unfinished_of(submitter)
        if have >= cap:
            raise ResourceExhausted(
                f"{shown(submitter)} already has {have} unfinished job(s), the most one submitter "
                f"may have (--max-jobs-per-submitter {cap}): cancel one, or wait for one to end"
            )

    def check_size(self, job: JobConfig) -> None:
        """ResourceExhausted when `job`'s largest stage is over the bounds: its state over
        --max-stage-bytes, or its state and one microbatch's activations (the least a peer
        computes with, whatever its own bounds: `swarm.model.footprint`) over the largest memory
        a present peer announced. Pure computation (a partition, modules on the meta device):
        call it off the event loop."""
        limits = []  # (bound, its name, what of a stage it bounds)
        if self.max_stage_bytes is not None:
            limits.append((self.max_stage_bytes, "--max-stage-bytes", False))
        memory, peer = self.peer_memory()
        if memory > 0:
            limits.append((memory, f"the largest memory a present peer announced ({peer})", True))
        if not limits:
            return
        state = stage_state_bytes(job)
        least = state
        if memory > 0:  # the least any peer needs: no activations kept, one being computed
            each = stage_footprints(
                job, activation_cache=0, activation_cache_bytes=0, chunk_bytes=0
            )
            least = [f.total for f in each]
        over = [
            (limit, why, need, max(range(len(need)), key=need.__getitem__))
            for limit, why, computing in sorted(limits)
            for need in [least if computing else state]
            if max(need) > limit
        ]
        if not over:
            return
        limit, why, need, largest = over[0]
        params = stage_parameters(job)
        also = (
            f" and {format_bytes(need[largest] - state[largest])} of one microbatch's activations"
            if need[largest] > state[largest]
            else ""
        )
        raise ResourceExhausted(
            f"job {job.name!r} is too large for this swarm: its stage {largest} holds "
            f"{params[largest]:,} parameters, {format_bytes(state[largest])} of state at least "
            f"(weights, gradient sums and {job.optimizer.kind}'s state in "
            f"{job.training.dtype}){also}, over {format_bytes(limit)}, {why}; the model has "
            f"{sum(params):,} parameters in {len(params)} stage(s): use more training.stages, "
            "or a smaller model"
        )
