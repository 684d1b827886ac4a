"""A submitted job's data files hashed once, however many submissions ask.

SubmitJob reads the whole data file to pin its sha256 into the stored spec, off the event loop.
A corpus of tens of GiB outlasts a client's deadline, and each retry (or a burst of
submissions naming the largest file under the data root) started another read of it, each
holding a worker thread of the default pool that every other `to_thread` waits on. Here a
file's hashing is one task, run to its end even when the submission that asked gives up, and
its outcome kept for the file as it is (its device, inode, size and modification time, and
what the checks read of the job): the retry finds it. Only a hash is kept: a file refused (not
readable, not UTF-8) is read again by the next submission, which may follow the operator's fix
(a permission, a disk back). One file is hashed at a time."""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from typing import Any

from swarm.job.config import JobConfig, verify_data
from swarm.model.data import check_token_ids

__all__ = ["DataHashes"]

KEPT = 64  # outcomes kept, the oldest forgotten first


class DataHashes:
    def __init__(self) -> None:
        self._tasks: OrderedDict[tuple[Any, ...], asyncio.Task[JobConfig]] = OrderedDict()
        self._one_at_a_time = asyncio.Lock()

    async def verified(self, job: JobConfig) -> JobConfig:
        """`verify_data(job)` (its data files' paths absolute): the job with its hashes pinned,
        or the ConfigError saying what is wrong with a file; from the task already hashing or
        done with the same files as they are now, where there is one."""
        key = await asyncio.to_thread(_identity, job)
        task = self._tasks.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.create_task(self._hashed(job))
            # its outcome read even where every asker has gone (no "never retrieved" later)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._tasks[key] = task
            while len(self._tasks) > KEPT:
                oldest = next(k for k, t in self._tasks.items() if t is not task)
                self._tasks.pop(oldest)
        self._tasks.move_to_end(key)
        return await asyncio.shield(task)  # the asker gone, the hashing goes on for the next

    async def _hashed(self, job: JobConfig) -> JobConfig:
        async with self._one_at_a_time:
            return await asyncio.to_thread(_verified, job)


def _verified(job: JobConfig) -> JobConfig:
    """The job with its hashes pinned, once its files pass the checks, its token ids too."""
    pinned = verify_data(job)
    check_token_ids(pinned)
    return pinned


def _identity(job: JobConfig) -> tuple[Any, ...]:
    """What a hashing's outcome rests on: each data file as it is now, and the job's data
    section and what the checks read of its model (`swarm.job.fingerprint.data_sha256`)."""
    files: list[object] = []
    for path in (job.data.path, job.data.val_path):
        if path is None:
            files.append(None)
            continue
        try:
            st = os.stat(path)
            files.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError as e:  # the check names it; a file made since is another key
            files.append(type(e).__name__)
    return (job.data, job.model.seq_len, job.model.vocab_size, *files)
