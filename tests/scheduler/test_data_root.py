"""The scheduler's data root (issue 27, item 13): a submitted job may name any file under it as
its data, and that file's bytes travel to the job's peers. So the root is never a default (the
working directory held the store, every job's checkpoints and the TLS key), and one that holds
what the scheduler keeps is refused at start, naming the conflict."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

import scheduler.main
from scheduler import cli
from scheduler.data_root import under_data_root
from scheduler.main import SchedulerProcessOptions, run_scheduler
from swarm.errors import ConfigError, InvalidArgument
from swarm.net import tls
from swarm.net.certs import init_ca, issue
from tests.support.tls import no_identity  # noqa: F401


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments("scheduler", parser)
    return parser.parse_args(list(argv))


def test_the_scheduler_needs_an_explicit_data_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []

    async def fake_run(opts: Any) -> None:
        started.append(opts)

    monkeypatch.setattr(scheduler.main, "run_scheduler", fake_run)
    monkeypatch.delenv("SWARM_DATA_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        cli.run("scheduler", _parse())
    assert "--data-root" in str(refused.value), refused.value
    assert started == [], "no scheduler starts without a data root"
    monkeypatch.setenv("SWARM_DATA_ROOT", str(tmp_path))  # named by the environment: enough
    assert cli.run("scheduler", _parse()) == 0
    assert [o.data_root for o in started] == [tmp_path]


async def _refused(opts: SchedulerProcessOptions) -> str:
    """What the scheduler says when it refuses to start with `opts` (it must, before it starts
    anything: a bounded wait, so that a scheduler that does start fails the test)."""
    with pytest.raises(ConfigError) as refused:
        await asyncio.wait_for(run_scheduler(opts), timeout=10)
    return str(refused.value)


async def test_a_data_root_holding_the_store_or_the_checkpoints_is_refused_at_start(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    store, checkpoints = tmp_path / "jobs.sqlite", tmp_path / "ckpt"
    said = await _refused(SchedulerProcessOptions(store, checkpoints, data_root=tmp_path))
    assert "--data-root" in said and "--store" in said and str(store) in said, said
    inside = SchedulerProcessOptions(data / "jobs.sqlite", checkpoints, data_root=data)
    said = await _refused(inside)
    assert "--store" in said and str(data / "jobs.sqlite") in said, said
    under_data = SchedulerProcessOptions(store, data / "ckpt", data_root=data)
    said = await _refused(under_data)
    assert "--checkpoint-dir" in said and str(data / "ckpt") in said, said
    # a root inside the checkpoints would serve every job's trained state just as well
    checkpoints.mkdir()
    said = await _refused(SchedulerProcessOptions(store, checkpoints, data_root=checkpoints))
    assert "--checkpoint-dir" in said, said
    missing = await _refused(SchedulerProcessOptions(store, checkpoints, data_root=tmp_path / "x"))
    assert "--data-root" in missing and "not a directory" in missing, missing
    assert not store.exists(), "refused before anything starts: no store was created"


async def test_a_data_root_holding_the_tls_files_is_refused_at_start(tmp_path: Path) -> None:
    certs, data = tmp_path / "data" / "certs", tmp_path / "data"
    init_ca(certs)
    issue(certs, "scheduler", ["127.0.0.1"])
    tls.configure(tls.Tls.load(certs / "ca.pem", certs / "scheduler.pem", certs / "scheduler.key"))
    opts = SchedulerProcessOptions(tmp_path / "jobs.sqlite", tmp_path / "ckpt", data_root=data)
    said = await _refused(opts)
    assert "--tls-" in said and str(certs) in said, said


@pytest.mark.parametrize("flag", ["token", "admin-token", "metrics-token", "scheduler-token"])
def test_a_data_root_holding_a_secret_file_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    # Any token holder may submit a job naming a directory under the data root as its starting
    # checkpoint, and fetch its files (FetchInit): the admin token's file there minted every
    # submitter's token. Before, only the store, the checkpoints and the TLS files were kept out.
    data = tmp_path / "data"
    data.mkdir()
    kept = data / f"{flag}.txt"
    kept.write_text("a-secret-of-the-schedulers\n")
    real = scheduler.main.run_scheduler

    async def bounded(opts: SchedulerProcessOptions) -> None:  # a scheduler that starts fails
        await asyncio.wait_for(real(opts), timeout=10)

    monkeypatch.setattr(scheduler.main, "run_scheduler", bounded)
    for name in ("SWARM_TOKEN", "SWARM_ADMIN_TOKEN", "SWARM_METRICS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    args = _parse(
        *("--data-root", str(data), "--store", str(tmp_path / "jobs.sqlite")),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), f"--{flag}-file", str(kept)),
    )
    with pytest.raises(ConfigError) as refused:
        cli.run("scheduler", args)
    said = str(refused.value)
    assert f"holds --{flag}-file {str(kept)!r}" in said, said
    assert not (tmp_path / "jobs.sqlite").exists(), "refused before anything starts"


def test_a_path_longer_than_any_the_system_opens_is_refused_before_it_is_resolved(
    tmp_path: Path,
) -> None:
    """A path of a megabyte (a submitted job's `data.path`, 95,000 components of `x/../`)
    had `realpath` look at each on the scheduler's event loop, and resolved to a real file
    under the root. No path the system opens is longer than PATH_MAX."""
    (tmp_path / "f").write_bytes(b"data")
    long = Path(str(tmp_path) + "/x/.." * 100_000 + "/f")
    with pytest.raises(InvalidArgument, match="longer than"):
        under_data_root(tmp_path, long, "data.path")
    assert under_data_root(tmp_path, tmp_path / "x" / ".." / "f", "data.path") == tmp_path / "f"
