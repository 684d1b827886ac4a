"""Each stored job's parsed config, for the job API's calls that need it (FetchData, FetchInit):
parsed once, off the event loop, however many calls ask at once.

Why: those calls parsed the stored spec at each call, in the default thread pool; a 1 MiB spec is
~0.8 s of the TOML parser's time with the GIL held, so a token holder keeping twenty calls open
kept the pool (the scheduler's other off-loop work: submissions' parses and data hashes, exports)
busy. A stored spec does not change; a job deleted and its id drawn again (six hex digits) has
another, so each is kept with its spec's digest. The `most` jobs asked last are kept: a parsed
config is small, and the specs themselves are not kept.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from scheduler.store_rows import JobRecord
from swarm.job.config import JobConfig, parse_job

__all__ = ["KEPT_JOBS", "ParsedJobs", "parse_stored"]

KEPT_JOBS = 64  # parsed configs kept, the least recently asked forgotten


def parse_stored(record: JobRecord) -> JobConfig:
    """`record`'s spec parsed as its job's files are served from (its data is not read)."""
    return parse_job(record.spec, Path(record.base_dir), record.name, check_data=False)


class ParsedJobs:
    """Parsed configs by job id (`get`); `parse` is the parser, run on a thread."""

    def __init__(
        self, parse: Callable[[JobRecord], JobConfig] = parse_stored, most: int = KEPT_JOBS
    ) -> None:
        self._parse, self._most = parse, most
        self._kept: OrderedDict[str, tuple[bytes, asyncio.Task[JobConfig]]] = OrderedDict()

    async def get(self, record: JobRecord) -> JobConfig:
        """`record`'s job parsed: at once where it was before, else by one parse that every
        call asking meanwhile shares (a ConfigError for a spec this version cannot parse)."""
        digest = hashlib.blake2b(record.spec.encode(), digest_size=16).digest()
        kept = self._kept.get(record.id)
        if kept is None or kept[0] != digest:
            task = asyncio.ensure_future(asyncio.to_thread(self._parse, record))
            task.add_done_callback(_retrieved)  # a failure no caller waits for any more
            kept = (digest, task)
            self._kept[record.id] = kept
            if len(self._kept) > self._most:
                self._kept.popitem(last=False)
        self._kept.move_to_end(record.id)
        try:
            return await asyncio.shield(kept[1])  # a caller gone leaves the parse to the rest
        except Exception:
            if self._kept.get(record.id) is kept:
                del self._kept[record.id]  # not kept: asked again, parsed again
            raise


def _retrieved(task: asyncio.Task[JobConfig]) -> None:
    if not task.cancelled():
        task.exception()
