"""A Python client of the scheduler's job API: submit, list, watch, cancel, delete and export jobs.

gRPC errors are converted here, at the boundary, into `ClientError`s whose message says what went
wrong in the user's words (e.g. "cannot reach the scheduler at HOST:PORT"); the `swarm.errors`
error the call's status means (`from_rpc_error`) is their `error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import grpc

from client.outage import WAIT_RETRY_S, Outage
from swarm.errors import PeerUnavailable, RemoteError, SwarmError, WireError
from swarm.job.config import load_job
from swarm.job.states import TERMINAL_PROTO as TERMINAL_STATES
from swarm.job.states import job_state_name as state_name
from swarm.net import dial
from swarm.net.submitters import SUBMITTER_KEY
from swarm.net.tls_mismatch import explain_grpc
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.status import from_rpc_error

if TYPE_CHECKING:
    import torch

__all__ = ["TERMINAL_STATES", "ClientError", "SchedulerClient", "state_name"]

MiB = 1 << 20
# How long an ask of a view (`get_through`) may go unanswered before the view says the
# scheduler is silent: with `status --watch`'s 1 s interval, an outage shows within 10 s
# (issue 68 item 5), while the ask itself keeps its whole deadline.
NOTICE_S = 5.0
# How many times one submission is sent while it goes unanswered (no answer within the
# deadline, a broken or refused connection: the scheduler may have taken it; each time with its
# request id, so it makes one job at most), and the pause before the next.
SUBMIT_ATTEMPTS = 3
SUBMIT_PAUSE_S = 1.0
JobStatus = scheduler_pb2.JobStatus
_Statuses = list[JobStatus]  # inside SchedulerClient, `list` names its method


class ClientError(SwarmError):
    """A call to the scheduler failed; `code` is the gRPC status code's name (e.g. NOT_FOUND),
    `error` the `swarm.errors` error it means (None for a reply the client itself rejected);
    `unanswered`: the scheduler did not answer (down, restarting, or the network between is),
    which asking again may mend, unlike a refusal or TLS on one side only."""

    def __init__(
        self,
        code: str,
        details: str,
        message: str,
        error: SwarmError | None = None,
        *,
        unanswered: bool = False,
    ) -> None:
        super().__init__(message)
        self.code, self.details, self.error = code, details, error
        self.unanswered = unanswered


class SchedulerClient:
    """Use inside a running event loop; `async with` (or `close()`) releases the channel."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        submitter_token: str | None = None,  #: who this client is to the job API (or admin's)
        timeout_s: float = 30.0,  #: deadline of each unary call (seconds)
        export_timeout_s: float = 600.0,  #: deadline of a whole model export (seconds)
        max_message_bytes: int = 64 * MiB,  #: largest message accepted (> the server's chunks)
        max_tensor_bytes: int = 1 << 36,  #: largest single tensor an export may declare (bytes)
    ) -> None:
        self.address, self.timeout_s, self.export_timeout_s = address, timeout_s, export_timeout_s
        self._max_tensor = max_tensor_bytes
        options = [("grpc.max_receive_message_length", max_message_bytes)]
        self._channel = dial.channel(address, token=token, options=options)
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        # Sent beside the swarm token: the scheduler records the submitter of a job, and lets
        # only them (or an admin) cancel, delete or export it.
        self._metadata = ((SUBMITTER_KEY, submitter_token),) if submitter_token else None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @contextlib.contextmanager
    def _converting(self) -> Iterator[None]:
        try:
            yield
        except grpc.RpcError as e:
            raise _client_error(self.address, e) from None

    async def _unary(self, method: Any, request: Any) -> Any:
        with self._converting():
            return await method(request, timeout=self.timeout_s, metadata=self._metadata)

    # -- the API --------------------------------------------------------------------------------
    async def submit(self, path: str | Path) -> JobStatus:
        """Validate the job file here (a bad one fails before any network call), then submit it.
        Relative data paths resolve on the scheduler against this file's absolute directory."""
        path = Path(path)
        job = load_job(path)  # raises ConfigError naming the key
        text = path.read_bytes().decode("utf-8")
        if "name" not in tomllib.loads(text):  # keep the file-stem default load_job applied
            text = f'name = "{job.name}"\n{text}'
        request = scheduler_pb2.SchedulerSubmitJobRequest(
            spec=text, base_dir=str(path.resolve().parent), request_id=secrets.token_hex(16)
        )
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            try:
                answer = await self._unary(self._stub.SubmitJob, request)
                return answer.job  # type: ignore[no-any-return]
            except ClientError as e:
                # Unanswered (no answer in time, a connection that broke or was refused): the
                # scheduler may have taken it, and asking again with its id makes no second job.
                # A refusal, or TLS on one side only, is said at once.
                if not e.unanswered:
                    raise
                if attempt == SUBMIT_ATTEMPTS:
                    raise ClientError(
                        e.code,
                        e.details,
                        f"{e} ({attempt} times); it may have taken the job all the same: "
                        "`swarm jobs` lists it if so",
                        e.error,
                        unanswered=True,
                    ) from None
                await asyncio.sleep(SUBMIT_PAUSE_S * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def get(self, job: str) -> JobStatus:
        request = scheduler_pb2.SchedulerGetJobRequest(job=job)
        return (await self._unary(self._stub.GetJob, request)).job  # type: ignore[no-any-return]

    async def list(self, page_size: int = 0) -> _Statuses:
        """Every job, newest first, without its spec (`get` has one's), asked for a page of
        `page_size` at a time (0: the scheduler's default)."""
        jobs: _Statuses = []
        token, seen = "", set()
        while True:
            request = scheduler_pb2.SchedulerListJobsRequest(page_size=page_size, page_token=token)
            page = await self._unary(self._stub.ListJobs, request)
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return jobs
            if token in seen:  # a scheduler's bug must not loop this forever
                raise ClientError("DATA_LOSS", token, "the scheduler's pages of jobs repeat")
            seen.add(token)

    async def cancel(self, job: str) -> JobStatus:
        request = scheduler_pb2.SchedulerCancelJobRequest(job=job)
        return (await self._unary(self._stub.CancelJob, request)).job  # type: ignore[no-any-return]

    async def delete(self, job: str) -> None:
        """Delete a finished job: its record, checkpoints and final model (a queued or running
        one is refused: cancel it first)."""
        await self._unary(self._stub.DeleteJob, scheduler_pb2.SchedulerDeleteJobRequest(job=job))

    async def get_through(
        self,
        job: str,
        outage: Outage,
        on_unreachable: Callable[[Outage], None],
        notice_s: float = NOTICE_S,
    ) -> JobStatus:
        """`get`, asked again (backing off) while the scheduler does not answer: `on_unreachable`
        sees the `outage` after each unanswered ask, and every `notice_s` an ask goes on
        unanswered (a pulled router leaves a call hanging until its deadline, `timeout_s`: the
        view says so long before). Raises the last error once the outage has lasted
        `outage.retry_for_s`, and at once for one that asking again cannot mend."""
        while True:
            try:
                status = await self._noticed(self.get(job), outage, on_unreachable, notice_s)
            except ClientError as e:
                pause = outage.failed() if e.unanswered else None
                if pause is None:
                    if e.unanswered:
                        raise ClientError(
                            e.code, e.details, f"{e}; {outage.gave_up()}", e.error
                        ) from None
                    raise
                on_unreachable(outage)
                await asyncio.sleep(pause)
                continue
            outage.answered()
            return status

    @staticmethod
    async def _noticed(
        ask: Awaitable[JobStatus],
        outage: Outage,
        on_unreachable: Callable[[Outage], None],
        notice_s: float,
    ) -> JobStatus:
        """`ask`'s answer; while it is unanswered, `on_unreachable(outage)` every `notice_s`,
        the outage timed from the last answer (`Outage.overdue`). The ask is not cut short: a
        slow scheduler that answers late is still heard."""
        task = asyncio.ensure_future(ask)
        try:
            while not (await asyncio.wait({task}, timeout=notice_s))[0]:
                outage.overdue()
                on_unreachable(outage)
            return task.result()
        finally:
            task.cancel()  # a no-op once it is done; Ctrl-C must not leave the ask behind

    async def wait(
        self,
        job: str,
        on_update: Callable[[JobStatus], None],
        poll_s: float = 0.5,
        *,
        retry_for_s: float = WAIT_RETRY_S,
        on_unreachable: Callable[[Outage], None] = lambda outage: None,
    ) -> JobStatus:
        """Poll until the job is succeeded, failed or cancelled; `on_update` sees every poll. A
        scheduler that does not answer is asked again for `retry_for_s` (`get_through`)."""
        outage = Outage(retry_for_s)
        while True:
            status = await self.get_through(job, outage, on_unreachable)
            on_update(status)
            if status.state in TERMINAL_STATES:
                return status
            await asyncio.sleep(poll_s)

    async def export(self, job: str, out: str | Path) -> int:
        """Download the job's whole model and `torch.save` its state_dict to `out` (written to a
        temporary file first, so a failed export leaves no partial file). Returns its step."""
        out = Path(out)
        tmp = out.with_name(f".{out.name}.partial")
        try:
            with open(tmp, "wb") as f:  # fails now, not after a long download
                state, step = await self._download(job)
                import torch  # here: `swarm status` and friends start in a blink without it

                await asyncio.to_thread(torch.save, state, f)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return step

    async def export_routes(self, job: str, out: str | Path) -> int:
        """Write the job's route record (pool.mode = "local", `swarm.model.routes`) to `out`, via
        a temporary file; returns its bytes."""
        out = Path(out)
        tmp, size = out.with_name(f".{out.name}.partial"), 0
        request = scheduler_pb2.SchedulerExportRoutesRequest(job=job)
        try:
            with open(tmp, "wb") as f, self._converting():
                async for part in self._stub.ExportRoutes(
                    request, timeout=self.export_timeout_s, metadata=self._metadata
                ):
                    await asyncio.to_thread(f.write, part.data)
                    size += len(part.data)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    async def export_hf(self, job: str, out: str | Path, dtype: str | None = None) -> int:
        """Download the job's whole model and write it as a Hugging Face checkpoint directory
        `out` (`model.safetensors`, `config.json`; weights in `dtype` if given, e.g.
        "bfloat16"), built aside and renamed into place. Returns its step."""
        import torch

        from swarm.job.config import parse_job
        from swarm.model.hf import write_hf
        from swarm.model.transformer import plain_state

        status = await self.get(job)
        # The model's shape only: the data need not be where this client runs.
        config = parse_job(status.spec, Path(status.base_dir or "."), check_data=False)
        if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            raise FileExistsError(f"{out} exists and is not an empty directory")
        state, step = await self._download(job)
        stored = getattr(torch, dtype) if dtype else None
        await asyncio.to_thread(write_hf, out, *plain_state(config, state), stored)
        return step

    async def _download(self, job: str) -> tuple[dict[str, torch.Tensor], int]:
        from swarm.wire import chunking  # tensors: torch, imported by the one command that needs it

        request = scheduler_pb2.SchedulerExportModelRequest(job=job)
        state: dict[str, torch.Tensor] = {}
        steps: set[int] = set()
        with self._converting():
            call = self._stub.ExportModel(
                request, timeout=self.export_timeout_s, metadata=self._metadata
            )
            stream: AsyncIterator[Any] = call.__aiter__()  # one iterator across messages
            while True:
                try:
                    received = await chunking.receive(stream, max_bytes=self._max_tensor)
                    tensors = chunking.decode_named(received)
                except chunking.EndOfStream:
                    break
                except WireError as e:  # the scheduler's bug, not the user's input
                    raise ClientError(
                        "DATA_LOSS", str(e), f"the export arrived damaged: {e}"
                    ) from None
                steps.add(received.header.step)
                for name, tensor in tensors.items():
                    if name in state:
                        raise ClientError("DATA_LOSS", name, f"the export sent {name!r} twice")
                    state[name] = tensor
        if len(steps) != 1:
            what = f"mixed steps {sorted(steps)}" if steps else "no tensors"
            raise ClientError("DATA_LOSS", what, f"the export of {job!r} sent {what}")
        return state, steps.pop()


def _client_error(address: str, e: grpc.RpcError) -> ClientError:
    error = from_rpc_error(e)
    code: str = e.code().name  # type: ignore[attr-defined]
    details: str = e.details() or ""  # type: ignore[attr-defined]
    unanswered = False
    if isinstance(error, PeerUnavailable) and code == "DEADLINE_EXCEEDED":
        message, unanswered = f"the scheduler at {address} did not answer in time", True
    elif isinstance(error, PeerUnavailable):
        # TLS on one side only, or a missing client certificate, reads "Socket closed": say so.
        hint = explain_grpc(address, details, "the scheduler")
        message = hint or f"cannot reach the scheduler at {address} ({details})"
        unanswered = hint is None  # asking again cannot change either side's flags
    elif isinstance(error, RemoteError) and error.code == "UNAUTHENTICATED":
        message = f"the scheduler at {address} refused the call: {details} (--token, SWARM_TOKEN)"
    else:
        message = details or code
    return ClientError(code, details, message, error, unanswered=unanswered)
