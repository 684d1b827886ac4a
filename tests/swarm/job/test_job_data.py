"""A job's data file under the scheduler: SubmitJob reads it only under the data root (off the
event loop), and pins its sha256 into the stored spec, so a remote trainer or a resumed scheduler
that finds other contents at the path refuses, naming the file and both hashes."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import swarm.job.config
from client.remote import run_remote_trainer
from scheduler.job_api import JobApiServicer
from scheduler.service import Scheduler, SchedulerOptions
from scheduler.store import JobStore
from swarm.bus.topics import Topics
from swarm.errors import ConfigError
from swarm.job import manifest
from swarm.job.config import load_job
from swarm.model.hf import write_hf
from swarm.model.transformer import build_model
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.lease import Lease
from tests.support.api import FakeControl
from tests.support.jobs import BASE, render, write_job

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20).encode()


def _spec(path: str, name: str = "text") -> str:
    model = {**BASE["model"], "vocab_size": 256}  # text tokens are bytes
    return render({**BASE, "model": model, "data": {"kind": "text", "path": path}}, name)


class _DoneControl(FakeControl):
    """Trains nothing, and tells a trainer that asks for work that the job is done."""

    async def lease(self, job_id: str, trainer: str, count: int, *_: Any, **__: Any) -> Lease:
        return Lease(0, [], [], done=True)


class _Bus:
    """Takes publications and forgets them (the scheduler announces jobs on it)."""

    topics = Topics()

    async def publish(self, topic: str, message: Any, retain: bool = False) -> None:
        pass


class _Api:
    def __init__(self, store: JobStore, servicer: JobApiServicer) -> None:
        self.store, self.servicer = store, servicer
        self.server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def submit(self, spec: str, base_dir: Path) -> scheduler_pb2.JobStatus:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            request = scheduler_pb2.SchedulerSubmitJobRequest(spec=spec, base_dir=str(base_dir))
            return (await stub.SubmitJob(request, timeout=10)).job

    async def refused(self, spec: str, base_dir: Path) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.submit(spec, base_dir)
        return info.value


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The data root (also the scheduler's current directory), with a corpus in it."""
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "corpus.txt").write_bytes(TEXT)
    (tmp_path / "outside.txt").write_bytes(TEXT)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
async def api(tmp_path: Path, root: Path) -> AsyncIterator[_Api]:
    store = JobStore(tmp_path / "jobs.sqlite")
    running = _Api(store, JobApiServicer(store, _DoneControl(store), data_root=root))
    await running.server.start()
    yield running
    await running.server.stop(None)
    store.close()


# -- item 13: the data root ---------------------------------------------------------------------
async def test_data_outside_the_root_is_refused(api: _Api, root: Path, tmp_path: Path) -> None:
    (root / "escape").symlink_to(tmp_path / "outside.txt")
    for path, base in [
        ("../../etc/passwd", root / "data"),
        ("/etc/passwd", root),
        (str(tmp_path / "outside.txt"), root),
        ("../outside.txt", root),
        ("escape", root),  # a symlink inside the root to a file outside it
        ("/nonexistent/file.txt", root),  # refused for where it is, not for being missing
    ]:
        error = await api.refused(_spec(path), base)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        details = error.details() or ""
        assert "outside the scheduler's data root" in details and str(root) in details, details
        assert "--data-root" in details
    assert api.store.list() == []


async def test_data_inside_the_root_is_accepted(api: _Api, root: Path) -> None:
    status = await api.submit(_spec("data/corpus.txt"), root)
    assert status.job.startswith("text-")
    (root / "link.txt").symlink_to(root / "data" / "corpus.txt")  # a symlink within the root
    assert (await api.submit(_spec(str(root / "link.txt"), "linked"), root)).job
    missing = await api.refused(_spec("data/nope.txt"), root)  # inside, but not there
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be read" in (missing.details() or "")


async def test_the_data_file_is_hashed_off_the_event_loop(
    api: _Api, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread, threads = threading.get_ident(), list[int]()
    real: Callable[..., str] = swarm.job.config.data_sha256

    def spy(*args: Any, **kwargs: Any) -> str:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(swarm.job.config, "data_sha256", spy)
    await api.submit(_spec("data/corpus.txt"), root)
    assert threads and loop_thread not in threads


async def test_the_event_loop_answers_while_a_large_file_hashes(
    api: _Api, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    real: Callable[..., str] = swarm.job.config.data_sha256

    def slow(*args: Any, **kwargs: Any) -> str:  # stands in for hashing many GiB
        started.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(swarm.job.config, "data_sha256", slow)
    submit = asyncio.create_task(api.submit(_spec("data/corpus.txt"), root))
    try:
        assert await asyncio.to_thread(started.wait, 10)
        async with grpc.aio.insecure_channel(api.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            listed = await stub.ListJobs(scheduler_pb2.SchedulerListJobsRequest(), timeout=5)
        assert list(listed.jobs) == []  # answered while the hash was still running
    finally:
        release.set()
        done = await asyncio.gather(submit, return_exceptions=True)
    assert isinstance(done[0], scheduler_pb2.JobStatus) and done[0].job


# -- item 2: the data is pinned at submit -------------------------------------------------------
async def test_submit_pins_the_data_sha256_into_the_stored_spec(api: _Api, root: Path) -> None:
    spec = _spec("data/corpus.txt")
    status = await api.submit(spec, root)
    stored = api.store.get(status.job)
    assert stored is not None
    pinned = tomllib.loads(stored.spec)
    assert pinned["data"]["sha256"] == hashlib.sha256(TEXT).hexdigest()
    del pinned["data"]["sha256"]
    assert pinned == tomllib.loads(spec)  # nothing else changed
    assert status.spec == stored.spec  # what remote trainers get


async def test_submit_pins_a_token_file_as_it_pins_text(api: _Api, root: Path) -> None:
    ids = bytes(b for i in range(256) for b in (i, 0))  # 256 uint16 ids, each < vocab_size
    (root / "data" / "tokens.bin").write_bytes(ids)
    spec = _spec("data/tokens.bin").replace('kind = "text"', 'kind = "tokens"')
    stored = api.store.get((await api.submit(spec, root)).job)
    assert stored is not None
    assert tomllib.loads(stored.spec)["data"]["sha256"] == hashlib.sha256(ids).hexdigest()
    outside = spec.replace("data/tokens.bin", str(root.parent / "outside.txt"))
    assert "data root" in (await api.refused(outside, root)).details()
    # a file made with a larger tokenizer: refused at submit, where the job failed at the step
    # whose microbatch drew such an id
    (root / "data" / "wide.bin").write_bytes(ids[:-2] + (300).to_bytes(2, "little"))
    refused = await api.refused(spec.replace("tokens.bin", "wide.bin"), root)
    assert "holds token id 300, outside model.vocab_size = 256" in refused.details()


async def test_submit_pins_the_initial_checkpoint_under_the_data_root(
    api: _Api, root: Path, tmp_path: Path
) -> None:
    model = {**BASE["model"], "kind": "llama", "n_heads": 4}
    job = load_job(write_job(tmp_path, "base", model=model))
    write_hf(root / "ckpt", build_model(job).state_dict(), job.model, None)
    spec = render({**BASE, "model": {**model, "init_from": "ckpt"}}, "finetune")
    stored = api.store.get((await api.submit(spec, root)).job)
    assert stored is not None
    digest = manifest.digest(manifest.manifest_of(root / "ckpt"))  # every file, config too
    assert tomllib.loads(stored.spec)["model"]["init_sha256"] == digest
    outside = spec.replace('"ckpt"', f'"{tmp_path}"')
    assert "model.init_from" in (await api.refused(outside, root)).details()


def _changed(root: Path) -> str:
    new = TEXT.replace(b"fox", b"cat")
    (root / "data" / "corpus.txt").write_bytes(new)
    return hashlib.sha256(new).hexdigest()


async def test_a_remote_trainer_refuses_changed_data(api: _Api, root: Path) -> None:
    status = await api.submit(_spec("data/corpus.txt"), root)
    pinned, now = hashlib.sha256(TEXT).hexdigest(), _changed(root)
    with pytest.raises(ConfigError) as info:
        await run_remote_trainer(api.address, status.job)
    message = str(info.value)
    assert str(root / "data" / "corpus.txt") in message and pinned in message and now in message


async def test_a_remote_trainer_starts_on_unchanged_data(api: _Api, root: Path) -> None:
    status = await api.submit(_spec("data/corpus.txt"), root)
    assert await run_remote_trainer(api.address, status.job) == 0


async def test_the_data_file_is_served_from_an_offset(api: _Api, root: Path) -> None:
    # A fetch broken off goes on from its partial file's size (swarm.rpc.fetch_file).
    status = await api.submit(_spec("data/corpus.txt"), root)
    async with grpc.aio.insecure_channel(api.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        request = scheduler_pb2.SchedulerFetchDataRequest(job=status.job, offset=100)
        got = b"".join([part.data async for part in stub.FetchData(request, timeout=10)])
    assert got == TEXT[100:]


async def test_a_remote_trainer_needs_no_starting_checkpoint_on_its_machine(
    api: _Api, root: Path, tmp_path: Path
) -> None:
    # A trainer loads no weights: a friend's, where the checkpoint's directory is not, keeps the
    # pin (issue 68 item 9). Before, it hashed the directory at start and stopped: not there.
    model = {**BASE["model"], "kind": "llama", "n_heads": 4}
    job = load_job(write_job(tmp_path, "base", model=model))
    write_hf(root / "ckpt", build_model(job).state_dict(), job.model, None)
    spec = render({**BASE, "model": {**model, "init_from": "ckpt"}}, "finetune")
    status = await api.submit(spec, root)
    (root / "ckpt").rename(tmp_path / "elsewhere")  # the trainer's machine has no such path
    assert await run_remote_trainer(api.address, status.job) == 0


async def _resume(tmp_path: Path, job_id: str) -> tuple[JobStore, asyncio.Task[None]]:
    store = JobStore(tmp_path / "jobs.sqlite")
    scheduler = Scheduler(store, _Bus(), SchedulerOptions(tmp_path / "ckpt"))  # type: ignore[arg-type]
    return store, asyncio.create_task(scheduler._run_job(job_id))


async def _state_when_settled(store: JobStore, job_id: str, want: set[str]) -> str:
    for _ in range(100):
        record = store.get(job_id)
        assert record is not None
        if record.state in want:
            return record.state
        await asyncio.sleep(0.05)
    record = store.get(job_id)
    assert record is not None
    return record.state


async def test_a_resumed_scheduler_refuses_changed_data(
    api: _Api, root: Path, tmp_path: Path
) -> None:
    status = await api.submit(_spec("data/corpus.txt"), root)
    pinned, now = hashlib.sha256(TEXT).hexdigest(), _changed(root)
    store, task = await _resume(tmp_path, status.job)
    try:
        assert await _state_when_settled(store, status.job, {"failed", "placing"}) == "failed"
        record = store.get(status.job)
        assert record is not None
        assert str(root / "data" / "corpus.txt") in record.error
        assert pinned in record.error and now in record.error
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


async def test_a_resumed_scheduler_trains_unchanged_data(
    api: _Api, root: Path, tmp_path: Path
) -> None:
    status = await api.submit(_spec("data/corpus.txt"), root)
    store, task = await _resume(tmp_path, status.job)
    try:  # waiting for peers: past the data check
        assert await _state_when_settled(store, status.job, {"failed", "placing"}) == "placing"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()


# -- the flag -----------------------------------------------------------------------------------
def test_the_data_root_flag_reaches_the_job_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    import scheduler.main
    from scheduler import cli

    got: list[Any] = []

    async def fake_run(opts: Any) -> None:
        got.append(opts)

    monkeypatch.setattr(scheduler.main, "run_scheduler", fake_run)
    parser = argparse.ArgumentParser()
    cli.add_arguments("scheduler", parser)
    store = str(tmp_path / "jobs.sqlite")  # not the default, in the working directory: the repo
    assert (
        cli.run("scheduler", parser.parse_args(["--data-root", str(tmp_path), "--store", store]))
        == 0
    )
    assert [o.data_root for o in got] == [tmp_path]  # no default: tests/scheduler/test_data_root
