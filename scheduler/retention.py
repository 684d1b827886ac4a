"""The scheduler's retention of finished jobs: each submitter's beyond `--keep-finished-jobs` (the
most recently ended of theirs are kept) are deleted, so one who ends many jobs deletes only their
own, their files (checkpoints, final model) then their records,
at the scheduler's start and whenever a job ends. A job still shutting down (a write in flight)
is left for the sweep at its own end; a failed deletion is logged and left for the next sweep."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from scheduler.logged import logged
from scheduler.store import JobStore

__all__ = ["Retention"]

log = logging.getLogger(__name__)


class Retention:
    """Sweeps `store`'s finished jobs beyond each submitter's `keep` most recently ended (None:
    keeps every one). `shutting_down(job)`: its task has not ended yet; `delete(job)`: removes
    its files."""

    def __init__(
        self,
        store: JobStore,
        keep: int | None,
        *,
        shutting_down: Callable[[str], bool],
        delete: Callable[[str], Awaitable[None]],
    ) -> None:
        self.store, self.keep = store, keep
        self._shutting_down, self._delete = shutting_down, delete
        self._sweeping = asyncio.Lock()  # one sweep at a time

    async def sweep(self) -> None:
        """Delete each submitter's finished jobs beyond `keep`: their files, then their records."""
        keep = self.keep
        if keep is None:
            return
        # A failed deletion is logged and left for the next sweep: it must not stop the scheduler.
        async with self._sweeping:
            beyond: list[str] = []
            with logged(log, "retention: finished jobs not listed"):
                beyond = self.store.finished_beyond(keep)
            for job_id in beyond:
                if self._shutting_down(job_id):
                    # Still shutting down (a write in flight): its end sweeps again.
                    log.info("job %s: deleted once it has shut down (retention)", job_id)
                    continue
                with logged(log, f"job {job_id}: not deleted (retention)"):
                    await self._delete(job_id)
                    self.store.delete(job_id)
                    log.info(
                        "job %s deleted: beyond its submitter's --keep-finished-jobs %d",
                        job_id,
                        keep,
                    )
