"""A job's status asked from the test's own process, as `swarm status --json` prints it (the same
message, turned into the same document): a `swarm status` process per look started an
interpreter each time, 0.4 s of CPU (1-3 s of wall on a busy machine), which the swarm under test
waited for on a 2-core machine while a test polled every 0.2-0.3 s. The tests that read what the
CLI itself prints run it once the state they wait for has come."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from google.protobuf import json_format

from client.live import status_lines
from client.sdk import ClientError, SchedulerClient
from swarm.proto import scheduler_pb2
from tests.support.cli import swarm
from tests.support.waiting import wait_until_blocking

ASKS = 3  # a look the scheduler did not answer is asked again, this many times in all

__all__ = ["job_status", "job_status_message", "job_status_text", "shown_once"]


def job_status_message(
    address: str, job_id: str, *, token: str | None = None
) -> scheduler_pb2.JobStatus:
    """The scheduler's `JobStatus` of `job_id` (a `ClientError` when it did not answer, asked
    `ASKS` times). A look opens a channel, whose handshake must come within the swarm's quarter
    of a second (`swarm.net.dial`'s reconnect backoff): on a machine 5x oversubscribed a look of
    a scheduler that is there now and then misses it, as a `swarm status` did, more rarely only
    because it looked 5 times less often."""

    async def get() -> scheduler_pb2.JobStatus:
        async with SchedulerClient(address, token=token, timeout_s=30) as client:
            return await client.get(job_id)

    for ask in range(1, ASKS + 1):
        try:
            return asyncio.run(get())
        except ClientError as e:
            if not e.unanswered or ask == ASKS:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def job_status(
    address: str, job_id: str, *, token: str | None = None, unanswered: bool = False
) -> dict[str, Any]:
    """`swarm status JOB --json`'s document; with `unanswered`, `{}` where the scheduler did not
    answer (a restart, say) instead of the `ClientError`."""
    try:
        status = job_status_message(address, job_id, token=token)
    except ClientError:
        if unanswered:
            return {}
        raise
    doc: dict[str, Any] = json_format.MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return doc


def job_status_text(address: str, job_id: str) -> str:
    """What `swarm status JOB` prints (`client.live.status_lines`, as the command prints it)."""
    return "\n".join(status_lines(job_status_message(address, job_id)))


def shown_once(address: str, job_id: str, what: str, timeout_s: float = 120.0) -> str:
    """What `swarm status JOB` prints once it says `what`, which is awaited in this process."""
    wait_until_blocking(
        lambda: what in job_status_text(address, job_id),
        f"swarm status saying {what!r}",
        timeout_s=timeout_s,
        every_s=0.3,
    )
    return swarm("status", job_id, "--scheduler", address).stdout
