"""The scheduler's settings (`swarm scheduler`'s flags): placement's and training's patience,
checkpoints by time, and how long an ended job's traces and files are kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ConfigError

__all__ = ["SchedulerOptions"]


@dataclass(frozen=True)
class SchedulerOptions:
    checkpoint_dir: Path
    placement_grace_s: float = 2.0  # once enough peers are measured, wait this long for more
    serve_timeout_s: float = 300.0  # assigned peers must be serving within this, else re-place
    retry_pause_s: float = 1.0  # after a failed training attempt, before the next one
    max_failed_attempts: int = 20  # consecutive attempts without progress before the job fails
    embedded_trainer: bool = True  # run a trainer inside the scheduler for each job
    dial_private: bool = False  # the dial-back may dial non-public addresses (--dial-private)
    load_silence_s: float = 10.0  # a serving peer whose load reports stop this long is left out
    # A trained job with a stage nobody serves (after a scheduler restart) waits this long for a
    # replica with the trained state, then gives the stage to fresh peers and rolls back.
    lost_stage_grace_s: float = 30.0
    # Every job is checkpointed at least this often besides its `checkpoint_every` steps: a
    # stage whose only replica dies costs minutes of training, not the job. None: by steps.
    checkpoint_every_s: float | None = 300.0
    token: str | None = None  # swarm token for calls to stage servers
    # Peer ids are bound to certificates (the embedded broker under --use-identity-as-username
    # takes a peer's user from its certificate): a ban bars every id its certificate certifies.
    bans_bind_credentials: bool = False
    # Replicas per stage placement gives every stage before any gets more, and rebalancing
    # leaves, for jobs whose `runtime.min_replicas` is 0 (unset).
    min_replicas: int = 1
    # An ended job's retained announcement and steps stay on the broker this long (peers that
    # were briefly away learn the end, and free themselves), then are cleared; its record stays
    # in the store, which is what `swarm status` reads. Its assignments are cleared at once.
    finished_retain_s: float = 300.0
    # Finished jobs kept (record, checkpoints, final model): those beyond the most recently ended
    # `keep_finished_jobs` are deleted at start and whenever a job ends. None: every one is kept.
    keep_finished_jobs: int | None = None
    # A cancelled job's task may still be shutting down (its last checkpoint or final model being
    # written, in a thread a cancellation does not stop): DeleteJob waits this long for it to
    # end, then refuses (try again), rather than delete files the write would make again.
    shutdown_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError(
                f"--min-replicas {self.min_replicas} is not allowed; use an integer >= 1"
            )
        if self.keep_finished_jobs is not None and self.keep_finished_jobs < 1:
            raise ConfigError(
                f"--keep-finished-jobs {self.keep_finished_jobs} is not allowed; use an integer "
                ">= 1, or leave it out to keep every finished job"
            )
