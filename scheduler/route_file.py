"""A job's route record on the scheduler's disk (`pool.mode = "local"`, `swarm.model.routes`):
appended a line per record as its steps commit, exported by `swarm routes`, replayed by
`swarm local --routes`.

A write the disk refuses (a full disk, the checkpoints' own) ends the record, not the job. It
raised out of the step's commit before: every attempt after it failed at its first record, and
the job failed after `max_failed_attempts`, while a checkpoint on the same disk was skipped and
training went on. A record with a gap, or a torn last line, would replay wrongly, so the file is
renamed `INCOMPLETE` (a rename needs no room), said at ERROR, and the job's later attempts (and a
restarted scheduler) record no more of it; an export says why and where what was kept lies."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TextIO

from swarm.errors import FailedPrecondition
from swarm.model.routes import Record, write_record

__all__ = ["INCOMPLETE", "RouteFile", "exportable", "incomplete_path"]

log = logging.getLogger(__name__)

INCOMPLETE = ".incomplete"  # the suffix of a record a write ended


def incomplete_path(path: Path) -> Path:
    """Where the record at `path` lies once a write ended it."""
    return path.with_name(path.name + INCOMPLETE)


def exportable(path: Path, job_id: str) -> None:
    """FailedPrecondition, saying why, unless job `job_id`'s record at `path` may be exported:
    none kept, or one a failed write ended (never served: a gap or a torn line)."""
    if path.is_file():
        return
    ended = incomplete_path(path)
    if ended.is_file():
        raise FailedPrecondition(
            f"job {job_id!r}'s route record ended where a write of it failed (a full disk, "
            "say: the scheduler's log says which): `swarm local --routes` cannot replay it; "
            f"what it kept is {ended.name} in the job's checkpoint directory"
        )
    raise FailedPrecondition(
        f'job {job_id!r} has no route record: only jobs with pool.mode = "local" (or '
        'delayed_update with pool.overlap = "eager") keep one, from their first step'
    )


class RouteFile:
    def __init__(self, path: Path, job_id: str) -> None:
        """The record at `path`, opened to append (a resumed job's record goes on)."""
        self.path, self.job_id = path, job_id
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 (`close`)

    @property
    def open(self) -> bool:
        return self._file is not None

    def __call__(self, record: Record) -> None:
        """Append `record` (nothing once a write ended the record)."""
        if self._file is None:
            return
        try:
            write_record(self._file, [record])
        except OSError as e:
            self.close()
            ended = incomplete_path(self.path)
            try:
                self.path.rename(ended)
                where = f"what it kept is {ended}"
            except OSError as gone:
                where = f"and it could not be set aside as {ended.name} ({gone})"
            log.error(
                "job %s: its route record ended: a write failed (%s); training goes on without "
                "it, `swarm local --routes` cannot replay this job, %s",
                self.job_id,
                e,
                where,
            )

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            # its last flush may fail on the same full disk: the record has ended anyway
            with contextlib.suppress(OSError):
                file.close()
