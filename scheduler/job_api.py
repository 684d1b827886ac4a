"""`SchedulerService`'s job API over a `JobStore` and the orchestration (`JobControl`,
`scheduler.job_control`).

The servicer is thin: validate, store, tell the orchestration, answer. Store reads and writes are
synchronous and happen between awaits, so a call never sees a half-made change. Errors become
status codes in `swarm.rpc.servicing`, as in every servicer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from scheduler import data_root as roots
from scheduler.admission import Admission
from scheduler.callers import Callers
from scheduler.data_hashes import DataHashes
from scheduler.job_control import JobControl
from scheduler.job_status import job_status
from scheduler.known_jobs import KnownJobs
from scheduler.parsed_jobs import ParsedJobs
from scheduler.route_file import exportable
from scheduler.store import JobRecord, JobStore
from scheduler.trainer_calls import TrainerCalls
from scheduler.trusted_peers import TrustMode
from swarm.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from swarm.job.config import (
    FILE_DATA,
    JobConfig,
    check_spec_size,
    parse_job,
    verify_init,
)
from swarm.job.pinning import pin, pin_data
from swarm.net.addresses import peer_host
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.lease import (
    lease_to_proto,
    result_from_proto,
    working_from_proto,
)
from swarm.rpc.reader_idle import READER_IDLE_S
from swarm.rpc.servicing import Servicing
from swarm.wire import chunking as wire

__all__ = [
    "LIST_PAGE_BYTES",
    "LIST_PAGE_MAX",
    "LIST_PAGE_SIZE",
    "MAX_BASE_DIR_BYTES",
    "MAX_EXPORTS",
    "MAX_FAILURE_CHARS",
    "MAX_REQUEST_ID_CHARS",
    "JobApiServicer",
    "job_status",
]

log = logging.getLogger(__name__)
MiB = 1 << 20
LIST_PAGE_SIZE = 100  # jobs per ListJobs page when the request sets none
LIST_PAGE_MAX = 1000  # and at most (a request for more gets this many)
# A ListJobs page ends once its jobs pass this many bytes (the next page goes on from there):
# records stored before their fields were bounded must not make a page no client can receive.
LIST_PAGE_BYTES = 1 * MiB
# The longest base_dir SubmitJob takes (bytes, UTF-8): PATH_MAX. It is stored and sent with the
# job in every GetJob and ListJobs answer.
MAX_BASE_DIR_BYTES = 4096
# ExportModel calls at once: each holds a whole model in the scheduler's memory (a 1B model in
# float32 is 4.4 GB); more are refused, RESOURCE_EXHAUSTED, until one ends.
MAX_EXPORTS = 2
# The most of a trainer's failure (`SchedulerReportMicrobatchesRequest.failure`) the scheduler
# keeps for the job's status: a cause is a line or a few, and status is no place for more.
MAX_FAILURE_CHARS = 2000
# A submission's request id (`SchedulerSubmitJobRequest.request_id`): a client's own token for
# it (swarm's are 32 hex digits), stored with the job it made; anything else is refused.
MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._-]{{0,{MAX_REQUEST_ID_CHARS}}}")
# The newest events of a job GetJob sends (`swarm status` shows them; the store keeps more).
STATUS_EVENTS = 50


def _request_id(request: scheduler_pb2.SchedulerSubmitJobRequest) -> str:
    if not _REQUEST_ID.fullmatch(request.request_id):
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} of A-Z, a-z, 0-9, '.', '_' and "
            f"'-' (swarm's MAX_REQUEST_ID_CHARS), got {request.request_id[:80]!r}"
        )
    return request.request_id


def _unknown(job_id: str) -> NotFound:
    shown = job_id[:80] + ("..." if len(job_id) > 80 else "")  # a caller's, of any length
    return NotFound(f"unknown job {shown!r}; `swarm jobs` lists them")


class JobApiServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        store: JobStore,
        control: JobControl,
        *,
        chunk_bytes: int = 4 * MiB,
        data_root: str | Path,
        callers: Callers | None = None,
        admission: Admission | None = None,
        trusted_peers: bool = False,  # --trusted-peers: `scheduler.trusted_peers`
    ) -> None:
        """`data_root`: the only directory (with its subdirectories) whose files SubmitJob reads
        as job data; no default (`scheduler.data_root` says why). `callers`: who calls (default:
        no submitter tokens; certificates' names under --tls-mutual); `admission`: what a job
        must fit (default: 8 unfinished jobs per submitter, sizes bounded by peers' memory)."""
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.store, self.control, self.chunk_bytes = store, control, chunk_bytes
        self.callers, self.admission = callers or Callers(), admission or Admission()
        self.data_root = Path(os.path.realpath(data_root))
        self._serving = Servicing("scheduler", reader_idle_s=READER_IDLE_S)
        # asked once each (until the store deletes a job)
        self._known = KnownJobs(
            lambda job: self._job(job).submitter, deletions=lambda: self.store.deletions
        )
        self.trainer_calls = TrainerCalls()  # bounded, each under its own trainer id
        self.trust = TrustMode(trusted_peers)
        self._exports = 0  # ExportModel calls under way (`MAX_EXPORTS`)
        self.data_hashes = DataHashes()  # each data file's hash, once
        self._parsed_jobs = ParsedJobs()  # each job's config, parsed once for its fetches

    # -- plumbing -------------------------------------------------------------------------------
    # Each call's body runs under the error mapping every servicer shares (`self._serving`); its
    # store reads and writes come before its first await (one call's never interleave another's).
    def _job(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        if record is None:
            raise _unknown(job_id)
        return record

    def _status(self, record: JobRecord, events: int = 0) -> scheduler_pb2.JobStatus:
        """`events`: how many of the job's newest events to include."""
        mean = record.mean_speed if record.finished else 0.0  # in its row: no sum of its steps
        shown = self.store.events(record.id, events) if events else []
        return job_status(record, self.control, shown, mean)  # `self.trust` says more, awaited

    # -- the service ----------------------------------------------------------------------------
    async def SubmitJob(
        self, request: scheduler_pb2.SchedulerSubmitJobRequest, context: Any
    ) -> scheduler_pb2.SchedulerSubmitJobResponse:
        async def body() -> scheduler_pb2.SchedulerSubmitJobResponse:
            caller = self.callers.identify(context)
            request_id = _request_id(request)
            made = await self._made(caller.name, request_id)
            if made is not None:  # asked again (its answer lost): the job it made then
                return made
            self.admission.check_submit(self.store, caller.name)  # before any work for it
            # The request's free-form strings are stored and sent back with the job: each has a
            # bound (the spec's, MAX_SPEC_BYTES, is parse_job's), or one large job would make
            # every listing too large to receive.
            size = len(request.base_dir.encode())
            if size > MAX_BASE_DIR_BYTES:
                raise InvalidArgument(
                    f"base_dir is {size} bytes, over the {MAX_BASE_DIR_BYTES} bytes (PATH_MAX, "
                    "swarm's MAX_BASE_DIR_BYTES) a job's directory may have"
                )
            base_dir = Path(request.base_dir)
            if not base_dir.is_absolute() or "\0" in request.base_dir:  # no path holds a NUL
                raise InvalidArgument(
                    f"base_dir must be an absolute directory, got {request.base_dir!r}"
                )
            # Off the loop: a spec within its bound (1 MiB) may hold a 500,000-element array
            # under an unknown key, seconds of parsing before its refusal.
            job = await asyncio.to_thread(
                parse_job, request.spec, base_dir, name="job", check_data=False
            )
            await asyncio.to_thread(self.admission.check_size, job)  # off the loop: a partition
            spec = request.spec
            if job.data.kind in FILE_DATA:
                assert job.data.path is not None  # required for file data
                real = roots.under_data_root(self.data_root, job.data.path, "data.path")
                val = job.data.val_path
                if val is not None:
                    val = roots.under_data_root(self.data_root, val, "data.val_path")
                # Off the event loop (hashing a large file would stall every other call), and
                # once for any number of submissions of one file (`scheduler.data_hashes`).
                checked = await self.data_hashes.verified(
                    replace(job, data=replace(job.data, path=real, val_path=val))
                )
                assert checked.data.sha256 is not None
                # Pinned into the stored spec: a remote trainer, or this scheduler after a
                # restart, refuses a file whose contents changed since.
                spec = await asyncio.to_thread(pin_data, spec, checked.data.sha256)
                if checked.data.val_sha256 is not None:
                    val_sha256 = checked.data.val_sha256
                    spec = await asyncio.to_thread(pin, spec, "data", "val_sha256", val_sha256)
            if job.model.init_from is not None:  # the initial checkpoint: read and pinned alike
                real = roots.under_data_root(self.data_root, job.model.init_from, "model.init_from")
                # every file under the root too: a friend's stage server fetches them all
                await asyncio.to_thread(roots.checkpoint_files, real, self.data_root)
                model = replace(job.model, init_from=real)
                pinned = await asyncio.to_thread(verify_init, replace(job, model=model))
                assert pinned.model.init_sha256 is not None
                init_sha256 = pinned.model.init_sha256
                spec = await asyncio.to_thread(pin, spec, "model", "init_sha256", init_sha256)
            # audits off under --trusted-peers, unless it asks; off the loop, as each pin: a
            # spec is parsed and written anew
            spec = await asyncio.to_thread(self.trust.stored, spec)
            check_spec_size(spec, "the job file with the hashes pinned")  # as trainers parse it
            # Again after the awaits, and with no await before the store has it: two calls of
            # one submitter at once cannot both take its last place, nor one request make two.
            made = await self._made(caller.name, request_id)  # not suspended where it made none
            if made is not None:
                return made
            self.admission.check_count(self.store, caller.name)
            record = self.store.create(
                job.name, spec, str(base_dir), job.training.steps, caller.name, request_id
            )
            log.info(
                "scheduler: job %s submitted by %r (%d steps)", record.id, caller.name, record.steps
            )
            self.control.submitted(record.id)
            status = await self.trust.shown(self._status(record))  # stored: awaits may come now
            return scheduler_pb2.SchedulerSubmitJobResponse(job=status)

        return await self._serving.run("SubmitJob", context, body)

    async def _made(
        self, submitter: str, request_id: str
    ) -> scheduler_pb2.SchedulerSubmitJobResponse | None:
        """The answer to a submission `submitter` made already by `request_id`, if it did. It
        awaits only where it did: else the caller goes on in the same turn of the loop."""
        record = self.store.by_request(submitter, request_id)
        if record is None:
            return None
        log.info(
            "scheduler: submission %s of %r asked again: job %s, made by it before",
            request_id,
            submitter,
            record.id,
        )
        status = await self.trust.shown(self._status(record))
        return scheduler_pb2.SchedulerSubmitJobResponse(job=status)

    async def GetJob(
        self, request: scheduler_pb2.SchedulerGetJobRequest, context: Any
    ) -> scheduler_pb2.SchedulerGetJobResponse:
        async def body() -> scheduler_pb2.SchedulerGetJobResponse:
            job = self._status(self._job(request.job), STATUS_EVENTS)
            return scheduler_pb2.SchedulerGetJobResponse(job=await self.trust.shown(job))

        return await self._serving.run("GetJob", context, body)

    async def ListJobs(
        self, request: scheduler_pb2.SchedulerListJobsRequest, context: Any
    ) -> scheduler_pb2.SchedulerListJobsResponse:
        async def body() -> scheduler_pb2.SchedulerListJobsResponse:
            # Pages, and no specs: every job at once, specs and all, outgrew any message. A page
            # also ends once past LIST_PAGE_BYTES (records stored before base_dir was bounded).
            size = min(request.page_size or LIST_PAGE_SIZE, LIST_PAGE_MAX)
            records, cursor = self.store.page(size, request.page_token, budget=LIST_PAGE_BYTES)
            jobs = [await self.trust.shown(self._status(r)) for r in records]
            return scheduler_pb2.SchedulerListJobsResponse(
                jobs=jobs, next_page_token=cursor, caller_host=peer_host(context.peer())
            )

        return await self._serving.run("ListJobs", context, body)

    async def CancelJob(
        self, request: scheduler_pb2.SchedulerCancelJobRequest, context: Any
    ) -> scheduler_pb2.SchedulerCancelJobResponse:
        async def body() -> scheduler_pb2.SchedulerCancelJobResponse:
            record = self._job(request.job)
            self.callers.identify(context).may_manage(record, "cancel")
            if record.finished:
                raise FailedPrecondition(f"job {record.id!r} is already {record.state}")
            record = self.store.set_state(record.id, "cancelled", message="cancelled on request")
            log.info("scheduler: job %s cancelled at step %d", record.id, record.step)
            self.control.cancelled(record.id)
            job = await self.trust.shown(self._status(record))  # cancelled: an await may come
            return scheduler_pb2.SchedulerCancelJobResponse(job=job)

        return await self._serving.run("CancelJob", context, body)

    async def DeleteJob(
        self, request: scheduler_pb2.SchedulerDeleteJobRequest, context: Any
    ) -> scheduler_pb2.SchedulerDeleteJobResponse:
        async def body() -> scheduler_pb2.SchedulerDeleteJobResponse:
            record = self._job(request.job)
            self.callers.identify(context).may_manage(record, "delete")
            if not record.finished:
                raise FailedPrecondition(f"job {record.id!r} is {record.state}; cancel it first")
            await self.control.delete(record.id)  # its files first: a failure keeps the record
            self.store.delete(record.id)
            self._known.forget(record.id)
            log.info("scheduler: job %s deleted", record.id)
            return scheduler_pb2.SchedulerDeleteJobResponse()

        return await self._serving.run("DeleteJob", context, body)

    async def LeaseMicrobatches(
        self, request: scheduler_pb2.SchedulerLeaseMicrobatchesRequest, context: Any
    ) -> scheduler_pb2.SchedulerLeaseMicrobatchesResponse:
        async def body() -> scheduler_pb2.SchedulerLeaseMicrobatchesResponse:
            submitter = self._known.check(request.job)
            return await self._lease(request, request.trainer_key, context, submitter)

        return await self._serving.run("LeaseMicrobatches", context, body)

    async def _lease(
        self,
        request: scheduler_pb2.SchedulerLeaseMicrobatchesRequest,
        key: bytes,
        context: Any,
        submitter: str,
    ) -> scheduler_pb2.SchedulerLeaseMicrobatchesResponse:
        """`request`'s lease, for a trainer calling as `context`'s caller, of a job of
        `submitter`'s."""
        self.trainer_calls.lease(request, key)
        # Any token holder may train a job, a replica's operator too; the step's contribution
        # audits (who is drawn, and q) reach only its own trainers: told them before its replica
        # sends its contribution, it would send an honest one exactly when drawn.
        own = self.callers.identify(context).manages(submitter)
        if not math.isfinite(request.wait_s) or request.wait_s < 0:
            raise InvalidArgument(f"wait_s must be a number >= 0, got {request.wait_s}")
        lease = await self.control.lease(
            request.job,
            request.trainer,
            request.count,
            wait_s=request.wait_s,
            working=working_from_proto(request),
        )
        return lease_to_proto(lease if own else lease.unaudited())

    async def ReportMicrobatches(
        self, request: scheduler_pb2.SchedulerReportMicrobatchesRequest, context: Any
    ) -> scheduler_pb2.SchedulerReportMicrobatchesResponse:
        async def body() -> scheduler_pb2.SchedulerReportMicrobatchesResponse:
            submitter = self._known.check(request.job)
            self.trainer_calls.report(request)  # all of it refused before any of it is taken
            results = [result_from_proto(r) for r in request.results]
            failure = request.failure[:MAX_FAILURE_CHARS] or None
            released = list(request.released)
            await self.control.report(request.job, request.trainer, results, released, failure)
            if not request.HasField("next"):
                return scheduler_pb2.SchedulerReportMicrobatchesResponse()
            return scheduler_pb2.SchedulerReportMicrobatchesResponse(
                lease=await self._lease(request.next, request.trainer_key, context, submitter)
            )

        return await self._serving.run("ReportMicrobatches", context, body)

    async def ExportModel(
        self, request: scheduler_pb2.SchedulerExportModelRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.SchedulerExportModelResponse]:
        async def body() -> AsyncIterator[scheduler_pb2.SchedulerExportModelResponse]:
            self.callers.identify(context).may_manage(self._job(request.job), "export")
            if self._exports >= MAX_EXPORTS:  # each holds a whole model in memory
                raise ResourceExhausted(
                    f"{MAX_EXPORTS} model exports are under way (swarm's MAX_EXPORTS), each "
                    "holding a whole model in the scheduler's memory: try again once one ends"
                )
            self._exports += 1
            try:
                step, state = await self.control.export(request.job)
                if not state:
                    raise FailedPrecondition(f"job {request.job!r} has no parameters to export")
                for name, tensor in state.items():
                    # Each chunk cut from the tensor's memory on a thread: a tensor encoded
                    # whole, or split, on the loop (an embedding's GB) stalls every other call.
                    header = scheduler_pb2.SchedulerExportModelResponse(step=step)
                    parts = wire.split_tensor(header, name, tensor, self.chunk_bytes)
                    while (part := await asyncio.to_thread(next, parts, None)) is not None:
                        yield part
            finally:
                self._exports -= 1

        async for part in self._serving.stream("ExportModel", context, body()):
            yield part

    async def ExportRoutes(
        self, request: scheduler_pb2.SchedulerExportRoutesRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.SchedulerExportRoutesResponse]:
        async def body() -> AsyncIterator[scheduler_pb2.SchedulerExportRoutesResponse]:
            self.callers.identify(context).may_manage(self._job(request.job), "export")
            path = self.control.routes(request.job)
            await asyncio.to_thread(exportable, path, request.job)
            async for data in roots.chunks(path, 0, self.chunk_bytes):
                yield scheduler_pb2.SchedulerExportRoutesResponse(data=data)

        async for part in self._serving.stream("ExportRoutes", context, body()):
            yield part

    async def FetchData(
        self, request: scheduler_pb2.SchedulerFetchDataRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.SchedulerFetchDataResponse]:
        async def body() -> AsyncIterator[scheduler_pb2.SchedulerFetchDataResponse]:
            job = await self._parsed(request.job)
            path = roots.data_file(job, request.validation, self.data_root)
            async for data in roots.chunks(path, request.offset, self.chunk_bytes, self.data_root):
                yield scheduler_pb2.SchedulerFetchDataResponse(data=data)

        async for part in self._serving.stream("FetchData", context, body()):
            yield part

    async def FetchInit(
        self, request: scheduler_pb2.SchedulerFetchInitRequest, context: Any
    ) -> AsyncIterator[scheduler_pb2.SchedulerFetchInitResponse]:
        """A file of the job's checkpoint, or its manifest (`path` empty): as FetchData."""

        async def body() -> AsyncIterator[scheduler_pb2.SchedulerFetchInitResponse]:
            job = await self._parsed(request.job)
            if request.path:
                path = await asyncio.to_thread(
                    roots.checkpoint_file, job, request.path, self.data_root
                )
                async for data in roots.chunks(
                    path, request.offset, self.chunk_bytes, self.data_root
                ):
                    yield scheduler_pb2.SchedulerFetchInitResponse(data=data)
                return
            # the manifest: its files hashed off the loop, and checked against the pin
            manifest = await asyncio.to_thread(roots.checkpoint_manifest, job, self.data_root)
            for at in range(request.offset, len(manifest), self.chunk_bytes):
                yield scheduler_pb2.SchedulerFetchInitResponse(
                    data=manifest[at : at + self.chunk_bytes]
                )

        async for part in self._serving.stream("FetchInit", context, body()):
            yield part

    async def _parsed(self, job_id: str) -> JobConfig:
        return await self._parsed_jobs.get(self._job(job_id))
