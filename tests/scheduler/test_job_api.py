"""The job API on a real gRPC server (port 0) over a real SQLite store, through `SchedulerClient`.
The orchestration is not under test: `tests.support.api.FakeControl` stands in for it."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

import scheduler.job_api
from client.remote import RemoteCoordinator
from client.sdk import ClientError, SchedulerClient
from scheduler import data_hashes
from scheduler.job_api import (
    LIST_PAGE_BYTES,
    MAX_BASE_DIR_BYTES,
    MAX_EXPORTS,
    MAX_FAILURE_CHARS,
)
from scheduler.route_file import incomplete_path
from scheduler.store import JobStore
from swarm.errors import ConfigError, NotFound, RemoteError
from swarm.job.config import verify_data
from swarm.job.key_depth import check_key_depth
from swarm.job.schema import MAX_SPEC_BYTES
from swarm.proto import control_pb2, scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc import servicing
from swarm.rpc.servicing import SAID_CHARS
from swarm.rpc.status import status_code
from tests.support.api import RunningApi, start_api
from tests.support.disks import fill, tiny_disk
from tests.support.jobs import BASE, make_job, render, write_job
from tests.support.ports import free_address as _free_address


@pytest.fixture
def free_address() -> str:
    """An address nothing listens on (bound, then released)."""
    return _free_address()


@pytest.fixture
async def client(api: RunningApi) -> AsyncIterator[SchedulerClient]:
    async with SchedulerClient(api.address, timeout_s=5.0) as c:
        yield c


async def test_submit_get_list(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    first = await client.submit(write_job(tmp_path, "first"))
    assert first.job.startswith("first-") and first.name == "first"
    assert first.state == control_pb2.JOB_STATE_QUEUED
    assert (first.step, first.steps, first.samples_per_second) == (0, 3, 12.5)
    assert math.isnan(first.loss) and first.created > 0
    assert first.stages[0].replicas[0].peer == "peer-a"
    assert api.control.submitted_ids == [first.job]
    # No `name` key: the job is named after its file, as `swarm local` would name it.
    nameless = tmp_path / "nameless.toml"
    nameless.write_text(render(BASE).split("\n", 1)[1])
    second = await client.submit(nameless)
    assert second.name == "nameless"
    stored = api.store.get(second.job)
    assert stored is not None and stored.base_dir == str(tmp_path.resolve())
    got = await client.get(first.job)
    assert got.job == first.job and got.state == control_pb2.JOB_STATE_QUEUED
    assert [j.job for j in await client.list()] == [second.job, first.job]


async def test_server_validates_the_spec(api: RunningApi) -> None:
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        bad = render({**BASE, "training": {**BASE["training"], "dtype": "float16"}})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(scheduler_pb2.SchedulerSubmitJobRequest(spec=bad, base_dir="/"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "training.dtype" in (e.value.details() or "")
        good = render(BASE)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SubmitJob(scheduler_pb2.SchedulerSubmitJobRequest(spec=good, base_dir="x"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "absolute" in (e.value.details() or "")
    assert api.store.list() == [] and api.control.submitted_ids == []


async def test_bad_job_file_fails_before_the_network(tmp_path: Path, free_address: str) -> None:
    path = write_job(tmp_path, training={"dtype": "float16"})
    async with SchedulerClient(free_address) as c:
        with pytest.raises(ConfigError, match=r"training\.dtype"):
            await c.submit(path)


async def test_unknown_job(client: SchedulerClient) -> None:
    for call in (client.get, client.cancel):
        with pytest.raises(ClientError, match="unknown job 'nope'; `swarm jobs` lists them") as e:
            await call("nope")
        assert e.value.code == "NOT_FOUND"
        assert isinstance(e.value.error, NotFound)  # the swarm error the status means


async def test_an_unknown_job_id_of_megabytes_is_not_echoed_whole(client: SchedulerClient) -> None:
    """The id went into the error's details whole (and its status trailer, and a log line): a
    caller's id of 3 MB came back as a metadata error instead of NOT_FOUND."""
    with pytest.raises(ClientError, match="unknown job 'xxx") as e:
        await client.get("x" * 3_000_000)
    assert e.value.code == "NOT_FOUND" and len(str(e.value)) < 1024


async def test_a_full_disk_under_the_store_is_refused_in_words_and_the_api_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A submit, a cancel and a delete whose write the store's full disk refused were answered
    # INTERNAL, logged as a bug with a traceback, though nothing was half-written: the disk is
    # the operator's to free, and the caller's to hear of.
    with tiny_disk(tmp_path / "disk") as disk:
        api = await start_api(disk)
        try:
            async with SchedulerClient(api.address, timeout_s=5.0) as client:
                job = (await client.submit(write_job(tmp_path, "before"))).job
                filler = fill(disk)
                with caplog.at_level(logging.INFO, logger="swarm.rpc"):
                    for call in (
                        lambda: client.submit(write_job(tmp_path, "after")),
                        lambda: client.cancel(job),
                    ):
                        with pytest.raises(ClientError, match=r"did not take a write.*full") as e:
                            await call()
                        assert e.value.code == "RESOURCE_EXHAUSTED", e.value
                assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
                assert [j.job for j in await client.list()] == [job]  # it reads on
                filler.unlink()
                await client.cancel(job)  # room again: it writes
                assert (await client.get(job)).state == control_pb2.JOB_STATE_CANCELLED
        finally:
            await api.stop()


async def test_a_write_the_store_refuses_for_no_disks_doing_is_answered_as_a_bug(
    api: RunningApi, client: SchedulerClient, tmp_path: Path
) -> None:
    # Only a disk's refusal is the operator's to free, said RESOURCE_EXHAUSTED: a write that
    # fails otherwise (here a write into a table the schema lacks: a bug) stays INTERNAL,
    # logged with its traceback, not told as a full disk.
    job = (await client.submit(write_job(tmp_path, "ok"))).job
    api.store._db.execute(  # the cancel's update of the job's row now writes to no table
        "CREATE TRIGGER a_bug BEFORE UPDATE ON jobs BEGIN INSERT INTO missing VALUES (1); END"
    )
    with pytest.raises(ClientError) as e:
        await client.cancel(job)
    assert e.value.code == "INTERNAL", e.value


async def test_cancel(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "idle"))).job
    cancelled = await client.cancel(job)
    assert cancelled.state == control_pb2.JOB_STATE_CANCELLED and cancelled.stages == []
    assert api.control.cancelled_ids == [job]
    with pytest.raises(ClientError, match="already cancelled") as e:
        await client.cancel(job)
    assert e.value.code == "FAILED_PRECONDITION"


async def test_wait_until_the_end(client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "run"))).job
    seen: list[int] = []
    final = await client.wait(job, lambda s: seen.append(s.step), poll_s=0.01)
    assert final.state == control_pb2.JOB_STATE_SUCCEEDED
    # An ended job's speed is its mean over its steps (16 samples in 0.02 s each), not zero.
    assert (final.step, final.loss, final.samples_per_second) == (3, 2.0, 800.0)
    assert seen == sorted(seen) and seen[-1] == 3


async def test_export(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "exp"))).job
    out = tmp_path / "model.pt"
    assert await client.export(job, out) == 7
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == api.control.state.keys()
    for name, tensor in api.control.state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


async def test_an_exports_chunks_are_cut_off_the_event_loop(
    api: RunningApi, client: SchedulerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk of an exported tensor is cut from its memory on a thread: a tensor encoded
    whole and split on the loop (an embedding of 0.5-1 GB) held every call for up to a second."""
    job = (await client.submit(write_job(tmp_path, "exp"))).job
    threads: list[threading.Thread] = []
    cut = scheduler.job_api.wire.split_tensor

    def watched(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for part in cut(*args, **kwargs):
            threads.append(threading.current_thread())
            yield part

    monkeypatch.setattr(scheduler.job_api.wire, "split_tensor", watched)
    assert await client.export(job, tmp_path / "model.pt") == 7
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, tensor in api.control.state.items():
        assert torch.equal(loaded[name], tensor)
    assert len(threads) > len(api.control.state), "every tensor cut in chunks"
    assert threading.main_thread() not in threads


async def test_exports_at_once_are_bounded_and_the_rest_told_to_come_back(
    api: RunningApi, client: SchedulerClient, tmp_path: Path
) -> None:
    # Each export holds the whole model in the scheduler's memory (read from its checkpoint,
    # or gathered from the replicas): any number of them at once sized its memory.
    job = (await client.submit(write_job(tmp_path, "exp"))).job
    held, most, ends = 0, 0, asyncio.Event()
    export = api.control.export

    async def slow(job_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        nonlocal held, most
        held += 1
        most = max(most, held)
        try:
            await ends.wait()
            return await export(job_id)
        finally:
            held -= 1

    api.control.export = slow  # type: ignore[method-assign]
    asked = [asyncio.create_task(client.export(job, tmp_path / f"model-{i}.pt")) for i in range(5)]
    await asyncio.sleep(0.5)
    ends.set()
    done = await asyncio.gather(*asked, return_exceptions=True)
    assert most == MAX_EXPORTS, most
    refused = [e for e in done if isinstance(e, ClientError)]
    assert len(refused) == 5 - MAX_EXPORTS and done.count(7) == MAX_EXPORTS, done
    assert all(e.code == "RESOURCE_EXHAUSTED" and "try again" in str(e) for e in refused)
    assert await client.export(job, tmp_path / "model.pt") == 7  # their room is given back


async def test_an_export_whose_reader_stops_reading_gives_its_place_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two exports whose readers took a part and stopped, their connections open, held both
    places (and a whole model each) for as long as their connections lived: every other export
    was refused. Each ends once its reader takes nothing for the job API's reader bound."""
    monkeypatch.setattr(scheduler.job_api, "READER_IDLE_S", 1.0)
    api = await start_api(tmp_path)
    api.control.state = {"big": torch.zeros(16 * 2**20)}  # 64 MiB: past what gRPC takes unread
    try:
        async with SchedulerClient(api.address) as client:
            job = (await client.submit(write_job(tmp_path, "exp"))).job
            async with grpc.aio.insecure_channel(api.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                request = scheduler_pb2.SchedulerExportModelRequest(job=job)
                stalled = [stub.ExportModel(request) for _ in range(MAX_EXPORTS)]
                for call in stalled:
                    await call.read()  # a part each, then no more
                with pytest.raises(ClientError, match="try again"):
                    await client.export(job, tmp_path / "refused.pt")
                api.control.state = {"small": torch.ones(4)}
                # past the bound both are let go (before: held on while connected)
                async with asyncio.timeout(30):
                    while True:
                        try:
                            assert await client.export(job, tmp_path / "model.pt") == 7
                            break
                        except ClientError as e:
                            assert "try again" in str(e)
                            await asyncio.sleep(0.2)
                for call in stalled:
                    call.cancel()
    finally:
        await api.stop()


async def test_a_data_file_is_hashed_once_however_many_submissions_ask(
    api: RunningApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each submission read the whole file again, in a thread of its own: a corpus that outlasts
    # the client's deadline was read again by each retry, and a burst of submissions held as
    # many of the default pool's threads.
    root = tmp_path / "data"
    root.mkdir(exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("hello world " * 1000)
    model = {**BASE["model"], "vocab_size": 256}  # bytes
    spec = render({**BASE, "model": model, "data": {"kind": "text", "path": "corpus.txt"}})
    read: list[Path | None] = []

    def slow(job: Any) -> Any:
        read.append(job.data.path)
        time.sleep(1.0)  # a large file's read
        return verify_data(job)

    monkeypatch.setattr(data_hashes, "verify_data", slow)
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        def submit(timeout: float) -> Any:
            request = scheduler_pb2.SchedulerSubmitJobRequest(spec=spec, base_dir=str(root))
            return stub.SubmitJob(request, timeout=timeout)

        answers = await asyncio.gather(*(submit(10) for _ in range(3)))
        assert len({a.job.job for a in answers}) == 3 and read == [corpus]
        corpus.write_text("other words " * 1000)  # changed: read again, once
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await submit(0.3)  # the client gives up as the file is read
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(1.2)
        await submit(10)  # the retry finds the read that went on without it
    assert read == [corpus, corpus]
    specs = [r.spec for r in api.store.list()]
    assert len(specs) == 4 and all("sha256" in spec for spec in specs)


async def test_a_data_file_refused_is_read_again_by_the_next_submission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read error (a disk's, a permission the operator then fixed: chmod moves no mtime) was
    # kept for the file as it was, and every submission after got it until a restart.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 1000)
    job = make_job(
        tmp_path,
        model={**BASE["model"], "vocab_size": 256},
        data={"kind": "text", "path": str(corpus)},
    )
    answers = [ConfigError("data.path cannot be read (Input/output error)")]

    def flaky(job: Any) -> Any:
        if answers:
            raise answers.pop()
        return verify_data(job)

    monkeypatch.setattr(data_hashes, "verify_data", flaky)
    hashes = data_hashes.DataHashes()
    with pytest.raises(ConfigError, match="Input/output error"):
        await hashes.verified(job)
    assert (await hashes.verified(job)).data.sha256 is not None  # read again, and kept now
    assert (await hashes.verified(job)).data.sha256 is not None


async def test_export_refused(client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "empty"))).job
    with pytest.raises(ClientError, match="no checkpoint") as e:
        await client.export(job, tmp_path / "model.pt")
    assert e.value.code == "FAILED_PRECONDITION" and not (tmp_path / "model.pt").exists()
    with pytest.raises(ClientError, match="unknown job") as e:
        await client.export("nope", tmp_path / "model.pt")


async def test_internal_error_keeps_serving(
    api: RunningApi, client: SchedulerClient, tmp_path: Path
) -> None:
    job = (await client.submit(write_job(tmp_path, "ok"))).job
    api.control.broken = True
    with pytest.raises(ClientError, match="RuntimeError: orchestration bug") as e:
        await client.get(job)
    assert e.value.code == "INTERNAL"
    assert isinstance(e.value.error, RemoteError) and e.value.error.code == "INTERNAL"
    api.control.broken = False
    assert (await client.get(job)).job == job


async def test_a_remote_trainers_give_back_carries_its_failure_to_the_job(
    tmp_path: Path, free_address: str
) -> None:
    # A remote trainer's released microbatches reached the scheduler without their cause: the
    # job's status, without the embedded trainer, could not name it.
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
    reported: list[tuple[str, list[int], str | None]] = []

    async def report(
        job: str, trainer: str, results: object, released: list[int], failure: str | None = None
    ) -> None:
        reported.append((trainer, released, failure))

    running = await start_api(tmp_path, address=free_address)
    running.control.report = report  # type: ignore[attr-defined]
    remote = RemoteCoordinator(free_address, job_id, timeout_s=5.0)
    try:
        await remote.release("t", [2], "stage 1: FAILED_PRECONDITION: handover refused")
        await remote.release("t", [3], "x" * (MAX_FAILURE_CHARS + 500))  # cut to its bound
        await remote.release("t", [4])  # none said: none kept
    finally:
        await remote.close()
        await running.stop()
    assert reported[0] == ("t", [2], "stage 1: FAILED_PRECONDITION: handover refused")
    assert reported[1] == ("t", [3], "x" * MAX_FAILURE_CHARS)
    assert reported[2] == ("t", [4], None)


async def test_a_remote_trainer_rides_out_a_scheduler_that_is_not_up_yet(
    tmp_path: Path, free_address: str
) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        job_id = store.create("test", render(BASE), str(tmp_path), 3).id
    remote = RemoteCoordinator(free_address, job_id, timeout_s=2.0, retry_for_s=30.0)
    try:
        asked = asyncio.create_task(remote.job())
        await asyncio.sleep(1.0)  # UNAVAILABLE meanwhile: it keeps asking
        assert not asked.done()
        running = await start_api(tmp_path, address=free_address)
        try:
            assert (await asyncio.wait_for(asked, 20)).job == job_id
            # A final answer is not asked again.
            unknown = RemoteCoordinator(free_address, "nope", retry_for_s=30.0)
            with pytest.raises(NotFound) as info:  # converted at the client's boundary
                await unknown.job()
            await unknown.close()
            assert status_code(info.value) == grpc.StatusCode.NOT_FOUND
        finally:
            await running.stop()
    finally:
        await remote.close()


# -- issue 27, items 12 and 14: bounds, sizes, pages, deletion ------------------------------------
async def _refused(api: RunningApi, spec: str, base_dir: str = "/") -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            request = scheduler_pb2.SchedulerSubmitJobRequest(spec=spec, base_dir=base_dir)
            await stub.SubmitJob(request, timeout=10)
    return e.value


async def test_malformed_submissions_and_pages_are_refused_as_bad_input(
    api: RunningApi, caplog: pytest.LogCaptureFixture
) -> None:
    # Each was an INTERNAL error with an ERROR traceback in the scheduler's log (or, the deep
    # key, seconds of the event loop's time in the TOML parser: 20,000 parts took 6 s, and a
    # 1 MiB spec of them hours), where each is the caller's mistake.
    deep_key = render(BASE) + "x" + ".a" * 20_000 + " = 1\n"
    deep_header = render(BASE) + "[x" + ".a" * 40 + "]\nk = 1\n"
    nested = render(BASE) + "x = " + "[" * 5000 + "]" * 5000 + "\n"
    data = {**BASE, "data": {"kind": "text", "path": "corpus.txt"}}
    for spec, base_dir, said in [
        (deep_key, "/", "a key of 20001 parts, over the 32 (swarm's MAX_KEY_PARTS)"),
        (deep_header, "/", "a key of 41 parts"),
        (nested, "/", "invalid TOML: values nested too deeply"),
        (render(data), "/a\x00b", "base_dir must be an absolute directory"),
    ]:
        refused = await _refused(api, spec, base_dir)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert said in (refused.details() or ""), refused.details()
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            request = scheduler_pb2.SchedulerListJobsRequest(page_token="0x1p0/" + "9" * 20)
            await stub.ListJobs(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert api.store.list() == []


@pytest.mark.attack("page-overflow")
@pytest.mark.attack("echo-whole")
async def test_a_page_token_past_a_floats_range_or_huge_is_bad_input_said_short(
    api: RunningApi, caplog: pytest.LogCaptureFixture
) -> None:
    """ "0x1p2000/0" overflowed the float its cursor is read as: an INTERNAL error with an ERROR
    traceback at each call. A 1 MB token was echoed whole in the refusal: a log line four times
    the request per call, and a status past the caller's metadata limit (a review found both)."""
    caplog.set_level(logging.INFO, logger="swarm.rpc.servicing")
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for token in ("0x1p2000/0", "\x00" * 1_000_000):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                request = scheduler_pb2.SchedulerListJobsRequest(page_token=token)
                await stub.ListJobs(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "is not one this scheduler gave" in (e.value.details() or "")
            assert len(e.value.details() or "") <= SAID_CHARS + 40
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2 and max(map(len, refused)) <= SAID_CHARS + 200, refused


def test_a_refusal_says_at_most_so_many_characters() -> None:
    assert servicing.said("short") == "short"
    long = servicing.said("x" * 10_000)
    assert long.startswith("x" * SAID_CHARS + "...") and long.endswith("(10000 characters)")


def test_a_job_files_dots_in_strings_and_comments_are_no_keys_parts() -> None:
    # The bound reads keys only: a data path, a multi-line string and a comment full of dots
    # are no key's, and TOML's own dotted keys of a few parts pass.
    dots = "." * 100
    spec = (
        render(BASE)
        + f"# {dots}\n[trust]\naudit_fraction = 0.5 # {dots}\n"
        + f'[data]\nkind = "text"\npath = "a{dots}txt"\n'
        + 'note.text = """\nx'
        + ".a" * 100
        + ' = 1\n"""\n'
    )
    check_key_depth(spec)
    with pytest.raises(ConfigError, match="line 1: a key of 33 parts"):
        check_key_depth("k" + ".k" * 32 + " = 1\n")


async def test_a_job_over_the_bounds_is_refused_at_submit(api: RunningApi) -> None:
    layers = render({**BASE, "model": {**BASE["model"], "n_layers": 20000}})
    refused = await _refused(api, layers)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.n_layers = 20000 is not allowed" in (refused.details() or "")
    assert "1..4096 (swarm's MAX_LAYERS)" in (refused.details() or "")
    model = {**BASE["model"], "n_layers": 4096}
    stages = render({**BASE, "model": model, "training": {**BASE["training"], "stages": 2000}})
    refused = await _refused(api, stages)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "training.stages = 2000 is not allowed" in (refused.details() or "")
    assert "1..512 (swarm's MAX_STAGES)" in (refused.details() or "")
    assert api.store.list() == [] and api.control.submitted_ids == []


async def test_a_spec_over_the_size_limit_is_refused_at_submit(
    api: RunningApi, client: SchedulerClient, tmp_path: Path
) -> None:
    padded = render(BASE) + "#" * MAX_SPEC_BYTES + "\n"  # a valid job file, just too large
    refused = await _refused(api, padded)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1048576 bytes" in (refused.details() or "") and "data.path" in (refused.details() or "")
    path = tmp_path / "large.toml"
    path.write_text(padded)
    with pytest.raises(ConfigError, match="1048576 bytes"):  # refused before the network too
        await client.submit(path)
    assert api.store.list() == []
    # A spec at the limit is taken.
    at_limit = render(BASE)
    at_limit += "#" * (MAX_SPEC_BYTES - len(at_limit.encode()) - 1) + "\n"
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        request = scheduler_pb2.SchedulerSubmitJobRequest(spec=at_limit, base_dir="/")
        assert (await stub.SubmitJob(request, timeout=10)).job.spec == at_limit


async def test_list_jobs_comes_in_pages_without_specs(
    api: RunningApi, client: SchedulerClient
) -> None:
    ids = [api.store.create("j", render(BASE), "/", 3).id for _ in range(5)]
    newest_first = ids[::-1]
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        seen: list[str] = []
        token = ""
        for want in (2, 2, 1):
            request = scheduler_pb2.SchedulerListJobsRequest(page_size=2, page_token=token)
            page = await stub.ListJobs(request, timeout=5)
            assert len(page.jobs) == want and all(j.spec == "" for j in page.jobs)
            seen += [j.job for j in page.jobs]
            token = page.next_page_token
            api.store.create("late", render(BASE), "/", 3)  # newer: not on the pages after
        assert token == "" and seen == newest_first
        with pytest.raises(grpc.aio.AioRpcError) as e:
            request = scheduler_pb2.SchedulerListJobsRequest(page_token="nonsense")
            await stub.ListJobs(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_token" in (e.value.details() or "")
    listed = await client.list(page_size=2)  # the SDK follows the pages
    assert [j.job for j in listed][3:] == newest_first
    assert [j.name for j in listed][:3] == ["late"] * 3
    assert (await client.get(ids[0])).spec == render(BASE)  # GetJob still has it


async def test_two_large_specs_do_not_break_the_listing(
    api: RunningApi, client: SchedulerClient
) -> None:
    """Specs stored by an older scheduler (no size limit then): 2 x 33 MB were one 66 MB answer,
    over the 64 MiB message limit, and `swarm jobs` failed for good."""
    large = render(BASE) + "#" * (33 << 20) + "\n"
    ids = [api.store.create("large", large, "/", 3).id for _ in range(2)]
    assert [j.job for j in await client.list()] == ids[::-1]


async def test_delete(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    job = (await client.submit(write_job(tmp_path, "idle"))).job
    with pytest.raises(ClientError, match=f"job '{job}' is queued; cancel it first") as e:
        await client.delete(job)
    assert e.value.code == "FAILED_PRECONDITION" and api.store.get(job) is not None
    await client.cancel(job)
    await client.delete(job)
    assert api.control.deleted_ids == [job] and api.store.get(job) is None
    for call in (client.get, client.delete):
        with pytest.raises(ClientError, match="unknown job") as e:
            await call(job)
        assert e.value.code == "NOT_FOUND"
    assert await client.list() == []


async def test_delete_needs_the_token(tmp_path: Path) -> None:
    running = await start_api(tmp_path, token="s3cret")
    try:
        job = running.store.create("done", render(BASE), "/", 3).id
        running.store.set_state(job, "cancelled")
        async with SchedulerClient(running.address) as anonymous:
            with pytest.raises(ClientError, match="refused the call") as e:
                await anonymous.delete(job)
            assert e.value.code == "UNAUTHENTICATED" and running.store.get(job) is not None
        async with SchedulerClient(running.address, token="s3cret") as authed:
            await authed.delete(job)
        assert running.store.get(job) is None
    finally:
        await running.stop()


async def test_a_base_dir_over_path_max_is_refused_at_submit(api: RunningApi) -> None:
    """base_dir is stored and returned by every GetJob and ListJobs page: unbounded, 25 jobs with
    a 3.5 MB one made a 90 MB listing no client could receive."""
    over = "/" + "d" * MAX_BASE_DIR_BYTES  # one byte over
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            request = scheduler_pb2.SchedulerSubmitJobRequest(spec=render(BASE), base_dir=over)
            await stub.SubmitJob(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = e.value.details() or ""
        assert "base_dir is 4097 bytes" in details and "4096" in details, details
        assert api.store.list() == [] and api.control.submitted_ids == []
        at_limit = "/" + "d" * (MAX_BASE_DIR_BYTES - 1)
        request = scheduler_pb2.SchedulerSubmitJobRequest(spec=render(BASE), base_dir=at_limit)
        assert (await stub.SubmitJob(request, timeout=10)).job.base_dir == at_limit


async def test_list_jobs_pages_end_at_a_byte_budget(
    api: RunningApi, client: SchedulerClient
) -> None:
    """Records stored before base_dir was bounded: 10 jobs with a 600 kB one were one 6 MB page,
    over a gRPC client's default 4 MiB receive limit. A page ends once past LIST_PAGE_BYTES."""
    large = "/" + "d" * 600_000
    ids = [api.store.create("wide", render(BASE), large, 3).id for _ in range(10)]
    async with grpc.aio.insecure_channel(api.address) as channel:  # the default 4 MiB limit
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        seen: list[str] = []
        sizes: list[int] = []
        token = ""
        while True:
            request = scheduler_pb2.SchedulerListJobsRequest(page_token=token)
            page = await stub.ListJobs(request, timeout=10)
            sizes.append(len(page.jobs))
            assert page.ByteSize() < LIST_PAGE_BYTES + 700_000  # the budget and one job at most
            seen += [j.job for j in page.jobs]
            token = page.next_page_token
            if not token:
                break
    assert seen == ids[::-1] and sizes == [2] * 5
    assert [j.job for j in await client.list()] == ids[::-1]  # the SDK follows the pages


async def test_export_routes(api: RunningApi, client: SchedulerClient, tmp_path: Path) -> None:
    """The record's bytes as the scheduler wrote them, streamed in chunks; a job without one
    (pool.mode = "step") says so; an unknown job is unknown."""
    job = (await client.submit(write_job(tmp_path, "exp"))).job
    out = tmp_path / "routes.jsonl"
    with pytest.raises(ClientError, match="no route record") as e:
        await client.export_routes(job, out)
    assert e.value.code == "FAILED_PRECONDITION" and not out.exists()
    api.control.routes_dir = tmp_path / "kept"
    api.control.routes_dir.mkdir()
    data = b"".join(b'{"step":%d,"runs":[]}\n' % i for i in range(5000))  # chunked
    api.control.routes(job).write_bytes(data)
    assert await client.export_routes(job, out) == len(data)
    assert out.read_bytes() == data
    with pytest.raises(ClientError, match="unknown job"):
        await client.export_routes("nope", out)
    # a record a failed write ended (`scheduler.route_file`): not served, and said so
    path = api.control.routes(job)
    path.rename(incomplete_path(path))
    with pytest.raises(ClientError, match="route record ended where a write of it failed") as e:
        await client.export_routes(job, tmp_path / "again.jsonl")
    assert e.value.code == "FAILED_PRECONDITION" and incomplete_path(path).name in str(e.value)
