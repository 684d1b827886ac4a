"""The scheduler serves a job's starting checkpoint (`SchedulerService.FetchInit`) over a real gRPC
server: its manifest, pinned at submit, then each file it names from an offset, to holders of the
swarm token only (as FetchData); a path outside the checkpoint, a file it does not list, a link
out of the data root, and a checkpoint changed since the submit are refused."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from scheduler import data_root as roots
from scheduler.job_api import JobApiServicer
from swarm.job.config import JobConfig, load_job, parse_job
from swarm.job.manifest import digest, manifest_of
from swarm.model.hf import write_hf
from swarm.model.transformer import build_model
from swarm.net import dial
from swarm.proto import scheduler_pb2, scheduler_pb2_grpc
from swarm.rpc.cache_room import Uses
from swarm.rpc.init_fetch import scheduler_init
from tests.support.api import RunningApi, start_api
from tests.support.jobs import BASE, render, write_job

TOKEN = "fetch-init-token-of-some-length"
MODEL = {**BASE["model"], "kind": "llama", "n_heads": 4}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[RunningApi]:
    (tmp_path / "data").mkdir()
    running = await start_api(tmp_path, token=TOKEN)
    yield running
    await running.stop()


def _checkpoint(tmp_path: Path) -> Path:
    job = load_job(write_job(tmp_path, "base", model=MODEL))
    ckpt = tmp_path / "data" / "ckpt"
    write_hf(ckpt, build_model(job).state_dict(), job.model, None)
    return ckpt


async def _call(
    api: RunningApi, method: str, request: object, token: str | None = TOKEN
) -> list[object]:
    channel = dial.channel(api.address, token=token)
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        call = getattr(stub, method)(request, timeout=30)
        return [r async for r in call] if method.startswith("Fetch") else [await call]
    finally:
        await channel.close()


async def _submit(api: RunningApi, tmp_path: Path) -> tuple[str, JobConfig]:
    """A fine-tuning job from `data/ckpt`; its id, and its config as a stage server elsewhere
    parses the announced spec (the checkpoint's path is not on its machine)."""
    spec = render({**BASE, "model": {**MODEL, "init_from": "ckpt"}}, "finetune")
    request = scheduler_pb2.SchedulerSubmitJobRequest(spec=spec, base_dir=str(tmp_path / "data"))
    [answer] = await _call(api, "SubmitJob", request)
    job_id = answer.job.job  # type: ignore[attr-defined]
    record = api.store.get(job_id)
    assert record is not None
    return job_id, parse_job(record.spec, Path("/"), "finetune", check_data=False)


async def test_a_member_fetches_the_checkpoint_a_stranger_is_refused(
    api: RunningApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _checkpoint(tmp_path)
    job_id, job = await _submit(api, tmp_path)
    assert job.model.init_sha256 == digest(manifest_of(ckpt))  # every file, config.json too
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "friend"))
    uses = Uses()
    got = await scheduler_init(api.address, TOKEN, uses)(job_id, job)
    assert got.model.init_from == tmp_path / "friend" / "init" / job.model.init_sha256
    assert uses.held(job_id) == [f"init/{job.model.init_sha256}"]  # by the job, for the agent
    assert manifest_of(got.model.init_from) == manifest_of(ckpt)
    for token in (None, "a-wrong-token-of-the-same-length"):
        request = scheduler_pb2.SchedulerFetchInitRequest(job=job_id, path="config.json")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _call(api, "FetchInit", request, token=token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, token


async def test_a_file_is_served_from_an_offset_and_only_the_checkpoints(
    api: RunningApi, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path)
    (tmp_path / "data" / "other.txt").write_text("another file under the data root")
    job_id, _ = await _submit(api, tmp_path)
    request = scheduler_pb2.SchedulerFetchInitRequest(job=job_id, path="config.json", offset=5)
    parts = await _call(api, "FetchInit", request)
    assert b"".join(p.data for p in parts) == (ckpt / "config.json").read_bytes()[5:]  # type: ignore[attr-defined]
    for path, code in [
        ("../other.txt", grpc.StatusCode.INVALID_ARGUMENT),
        ("/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
        ("absent.bin", grpc.StatusCode.NOT_FOUND),
    ]:
        request = scheduler_pb2.SchedulerFetchInitRequest(job=job_id, path=path)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _call(api, "FetchInit", request)
        assert refused.value.code() == code, path


async def test_a_link_out_of_the_data_root_is_refused_at_submit(
    api: RunningApi, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path)
    (tmp_path / "secret").write_text("not to be served")
    os.symlink(tmp_path / "secret", ckpt / "tokenizer.json")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _submit(api, tmp_path)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the scheduler's data root" in (refused.value.details() or "")


async def test_a_checkpoint_changed_since_the_submit_is_not_served(
    api: RunningApi, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path)
    job_id, _ = await _submit(api, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    request = scheduler_pb2.SchedulerFetchInitRequest(job=job_id)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _call(api, "FetchInit", request)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "changed on the scheduler's machine" in (refused.value.details() or "")


async def test_files_over_a_message_are_fetched_in_the_schedulers_own_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler's default chunk is 4 MiB of data, a message over gRPC's default 4 MiB limit.
    chunk = inspect.signature(JobApiServicer).parameters["chunk_bytes"].default
    monkeypatch.setattr("tests.support.api.CHUNK", chunk)
    (tmp_path / "data").mkdir()
    running = await start_api(tmp_path, token=TOKEN)
    try:
        ckpt = _checkpoint(tmp_path)
        (ckpt / "big.bin").write_bytes(os.urandom(9 << 20))  # three chunks, two of them whole
        job_id, job = await _submit(running, tmp_path)
        monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "friend"))
        kept = (await scheduler_init(running.address, TOKEN, Uses())(job_id, job)).model.init_from
        assert kept is not None and manifest_of(kept) == manifest_of(ckpt)
    finally:
        await running.stop()


async def test_a_link_swapped_in_after_the_check_is_not_followed(
    api: RunningApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The served path was resolved and checked to lie under the data root, then opened by name:
    # a file replaced by a link out of the root in between (by anyone who may write under it)
    # was followed, and its target served to any token holder. What is opened is checked now.
    _checkpoint(tmp_path)
    (tmp_path / "secret").write_text("not to be served")
    job_id, _ = await _submit(api, tmp_path)
    checked = roots.checkpoint_file

    def swapped(*args: object) -> Path:
        path = checked(*args)  # type: ignore[arg-type]
        path.unlink()
        os.symlink(tmp_path / "secret", path)
        return path

    monkeypatch.setattr(roots, "checkpoint_file", swapped)
    request = scheduler_pb2.SchedulerFetchInitRequest(job=job_id, path="config.json")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _call(api, "FetchInit", request)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "outside the scheduler's data root" in (refused.value.details() or "")


async def test_a_data_file_gone_since_the_submit_is_not_found_in_words(
    api: RunningApi, tmp_path: Path
) -> None:
    # A job's data file deleted on the scheduler's machine after the submit was answered
    # INTERNAL, with the open's FileNotFoundError and its path: a bug's answer, where the
    # operator has a file to put back.
    text = tmp_path / "data" / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 50)
    model = {**BASE["model"], "vocab_size": 256}
    spec = render({**BASE, "model": model, "data": {"kind": "text", "path": "corpus.txt"}}, "t")
    request = scheduler_pb2.SchedulerSubmitJobRequest(spec=spec, base_dir=str(tmp_path / "data"))
    [answer] = await _call(api, "SubmitJob", request)
    text.unlink()
    fetch = scheduler_pb2.SchedulerFetchDataRequest(job=answer.job.job)  # type: ignore[attr-defined]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _call(api, "FetchData", fetch)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()
    assert "is no longer on the scheduler's machine" in (refused.value.details() or "")


@pytest.mark.attack("fetch-offset")
async def test_an_offset_past_the_end_is_answered_empty_not_as_a_bug(
    api: RunningApi, tmp_path: Path
) -> None:
    """Any token holder names the offset: 2^63 failed the seek with a ValueError (2^62 an
    OSError), answered INTERNAL with a traceback at ERROR for each call. From the end on the
    answer is empty, as a read past a file's end is: a fetcher's own size check says the file
    shrank (`swarm.rpc.fetch_file`), as it did before for an offset just past it."""
    ckpt = _checkpoint(tmp_path)
    job_id, _ = await _submit(api, tmp_path)
    size = (ckpt / "config.json").stat().st_size
    for offset in (size, size + 1, 1 << 62, 1 << 63, (1 << 64) - 1):
        request = scheduler_pb2.SchedulerFetchInitRequest(
            job=job_id, path="config.json", offset=offset
        )
        assert b"".join(p.data for p in await _call(api, "FetchInit", request)) == b"", offset  # type: ignore[attr-defined]
