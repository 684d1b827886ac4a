"""The jobs the job API has found in the store (`KnownJobs`): leases and reports, the calls every
trainer makes many times a second, ask the store once per job, not at each call (a job deleted
since is the orchestration's to refuse: it has no record to lease from).

Bounded: the ids of every job ever asked for were kept for the scheduler's life, past the jobs
retention deleted. At most `MAX_KNOWN` are now, the least recently asked forgotten first: one
forgotten is looked up in the store again at its next call."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

__all__ = ["MAX_KNOWN", "KnownJobs"]

#: Job ids kept: far more than the jobs whose trainers call at once.
MAX_KNOWN = 4096


class KnownJobs:
    """`look_up(job_id)`, its submitter, raises for a job the store does not have; `check` asks
    it once per job kept."""

    def __init__(
        self,
        look_up: Callable[[str], str],
        most: int = MAX_KNOWN,
        deletions: Callable[[], int] = lambda: 0,
    ) -> None:
        """`deletions`: how many jobs the store has deleted (`JobStore.deletions`): when it
        moves, every job kept is looked up again, since a new job may have taken a deleted
        one's id, and with it another submitter (whose trainers would be told the audits)."""
        self._look_up, self.most, self._deletions = look_up, most, deletions
        self._ids: OrderedDict[str, str] = OrderedDict()  # job -> its submitter
        self._seen = deletions()

    def __len__(self) -> int:
        return len(self._ids)

    def check(self, job_id: str) -> str:
        """Refuse an unknown job (as `look_up` does); its submitter (a job's never changes)."""
        deletions = self._deletions()
        if deletions != self._seen:  # rare: a job deleted (retention, DeleteJob)
            self._ids.clear()
            self._seen = deletions
        submitter = self._ids.get(job_id)
        if submitter is not None:
            self._ids.move_to_end(job_id)
            return submitter
        submitter = self._ids[job_id] = self._look_up(job_id)
        while len(self._ids) > self.most:
            self._ids.popitem(last=False)
        return submitter

    def forget(self, job_id: str) -> None:
        """`job_id` was deleted: asked of the store again."""
        self._ids.pop(job_id, None)
