"""The CLI's client commands: `swarm submit|status|jobs|cancel|delete|export`.

Each command takes its parsed namespace and returns the exit code: 0 done, 1 failed (the job
failed or was cancelled, the scheduler is unreachable or refused; `submit --wait` and `status
--watch` ask an unreachable one again for `--retry-for`, `client.outage`), 2 bad input (a bad job
file, an unknown job, no scheduler address). Errors print `swarm <cmd>: error: <message>` to
stderr. `client.cli` declares their flags.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from google.protobuf import json_format
from tqdm import tqdm

from client.live import (
    event_lines_of,
    loss_text,
    shown,
    status_lines,
    table,
    watch_status,
)
from client.outage import WAIT_RETRY_S, Outage
from client.sdk import TERMINAL_STATES, ClientError, SchedulerClient
from swarm.errors import ConfigError, SwarmError
from swarm.flags import secret, token
from swarm.job.states import job_state_name as state_name
from swarm.ops.progress import duration_text
from swarm.proto import scheduler_pb2

__all__ = [
    "cmd_cancel",
    "cmd_delete",
    "cmd_export",
    "cmd_jobs",
    "cmd_status",
    "cmd_submit",
    "watch",
]

Command = Callable[[argparse.Namespace], int]

_BAD_INPUT = frozenset({"NOT_FOUND", "INVALID_ARGUMENT"})


class _Usage(SwarmError):
    """The command line itself is incomplete (exit 2)."""


def _fail(name: str, message: str, code: int) -> int:
    print(f"swarm {name}: error: {message}", file=sys.stderr)
    return code


def _guarded(name: str, body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Command:
    """Run `body` on a fresh event loop and turn its errors into a message and an exit code."""

    @functools.wraps(body)
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(body(args))
        except ClientError as e:
            return _fail(name, str(e), 2 if e.code in _BAD_INPUT else 1)
        except (ConfigError, _Usage) as e:
            return _fail(name, str(e), 2)
        except (SwarmError, OSError) as e:
            return _fail(name, str(e), 1)

    return run


def _client(args: argparse.Namespace) -> SchedulerClient:
    if not args.scheduler:
        raise _Usage("no scheduler address: pass --scheduler HOST:PORT or set SWARM_SCHEDULER")
    return SchedulerClient(
        args.scheduler,
        token=token(args),
        submitter_token=secret(args, "submitter-token"),
        timeout_s=args.timeout,
    )


def _outcome(name: str, status: scheduler_pb2.JobStatus) -> int:
    state = state_name(status.state)
    if state == "succeeded":
        print(f"job {status.job} succeeded: {status.step} steps, loss {loss_text(status.loss)}")
        return 0
    why = f": {status.error}" if status.error else ""
    return _fail(name, f"job {status.job} {state} at step {status.step}{why}", 1)


# -- the commands ---------------------------------------------------------------------------------
async def watch(
    client: SchedulerClient,
    status: scheduler_pb2.JobStatus,
    poll_s: float = 0.5,
    retry_for_s: float = WAIT_RETRY_S,
) -> scheduler_pb2.JobStatus:
    """Show a progress bar (step, loss, samples/s, how long the job has waited) until the job
    ends, with the job's events and what it waits for printed above it as they come; returns its
    last status. The bar is redrawn at every look, so its clock runs on while the job waits. A
    scheduler that does not answer is asked again for `retry_for_s`: the bar says since when,
    in place, and a line above it says when the outage began and ended."""
    seen_time, seen_message = status.created, ""
    outage_since: float | None = None
    with tqdm(total=status.steps, desc=status.job, unit="step", file=sys.stderr) as bar:

        def unreachable(outage: Outage) -> None:
            nonlocal outage_since
            if outage_since is None:
                bar.write(outage.text(), file=sys.stderr)
            outage_since = outage.since
            bar.set_postfix_str(outage.text(), refresh=True)

        def show(s: scheduler_pb2.JobStatus) -> None:
            nonlocal seen_time, seen_message, outage_since
            if outage_since is not None:
                lasted = duration_text(time.time() - outage_since)
                bar.write(f"scheduler answers again (unreachable for {lasted})", file=sys.stderr)
                outage_since = None
            told = set()
            for e in s.events:
                if e.time > seen_time:
                    bar.write(event_lines_of([e])[0], file=sys.stderr)
                    told.add(e.text)
                    seen_time = e.time
            if s.message != seen_message:
                seen_message = s.message
                # An ended job's last word is its event and the outcome line printed after.
                if s.message and s.message not in told and s.state not in TERMINAL_STATES:
                    bar.write(f"{state_name(s.state)}: {shown(s.message)}", file=sys.stderr)
            postfix = {
                "state": state_name(s.state),
                "loss": loss_text(s.loss),
                "samples_s": f"{s.samples_per_second:.1f}",
            }
            if s.waiting_since:
                postfix["waiting"] = duration_text(time.time() - s.waiting_since)
            bar.set_postfix(postfix, refresh=False)
            bar.n = s.step
            bar.refresh()

        try:
            return await client.wait(
                status.job, show, poll_s=poll_s, retry_for_s=retry_for_s, on_unreachable=unreachable
            )
        except asyncio.CancelledError:  # Ctrl-C: the job itself keeps running
            bar.close()
            print(f"stopped watching; `swarm cancel {status.job}` stops the job", file=sys.stderr)
            raise


async def _submit(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        status = await client.submit(args.job_file)
        print(status.job, flush=True)
        if not args.wait:
            return 0
        final = await watch(client, status, args.poll, args.retry_for)
    return _outcome("submit", final)


async def _status(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        if args.watch:
            outage = Outage(args.retry_for)
            final = await watch_status(
                lambda unreachable: client.get_through(args.job, outage, unreachable),
                sys.stdout,
                interval_s=args.interval,
                tty=sys.stdout.isatty(),
                done=lambda s: s.state in TERMINAL_STATES,
            )
            return _outcome("status", final)
        s = await client.get(args.job)
    if args.json:
        doc = json_format.MessageToDict(
            s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        print(json.dumps(doc, indent=2))
        return 0
    print("\n".join(status_lines(s)))
    return 0


async def _jobs(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        jobs = await client.list()
    if not jobs:
        print("no jobs")
        return 0
    rows = [["JOB", "NAME", "STATE", "STEP", "LOSS", "SAMPLES/S", "CREATED", "SUBMITTER"]]
    for j in jobs:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created))
        rows.append(
            [
                j.job,
                j.name,
                state_name(j.state),
                f"{j.step}/{j.steps}",
                loss_text(j.loss),
                f"{j.samples_per_second:.1f}",
                created,
                j.submitter or "-",  # "-": the swarm token alone
            ]
        )
    print(table(rows))
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        s = await client.cancel(args.job)
    print(f"job {s.job} cancelled at step {s.step}/{s.steps}")
    return 0


async def _delete(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        await client.delete(args.job)
    print(f"job {args.job} deleted, with its checkpoints and final model")
    return 0


async def _export(args: argparse.Namespace) -> int:
    if args.out is None and args.routes is None:
        raise SystemExit("swarm export: give --out FILE (the model), --routes FILE, or both")
    async with _client(args) as client:
        if args.routes is not None:
            try:
                size = await client.export_routes(args.job, args.routes)
            except OSError as e:
                raise OSError(f"cannot write {args.routes} ({e.strerror or e})") from None
            print(f"wrote {args.routes} (job {args.job}'s route record, {size} bytes)")
            if args.out is None:
                return 0
        try:
            if args.format == "hf":
                step = await client.export_hf(args.job, args.out, args.dtype)
            else:
                step = await client.export(args.job, args.out)
        except OSError as e:
            raise OSError(f"cannot write {args.out} ({e.strerror or e})") from None
    print(f"wrote {args.out} (job {args.job}, after {step} steps)")
    return 0


cmd_submit = _guarded("submit", _submit)
cmd_status = _guarded("status", _status)
cmd_jobs = _guarded("jobs", _jobs)
cmd_cancel = _guarded("cancel", _cancel)
cmd_delete = _guarded("delete", _delete)
cmd_export = _guarded("export", _export)
