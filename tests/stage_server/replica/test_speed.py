"""A joining peer's measurement of its samples/s per stage, the input of placement."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from stage_server.cli import LIFECYCLE_LOGGERS
from stage_server.replica import speed
from stage_server.replica.speed import device_model, measure_job
from swarm.job.config import load_job
from tests.support import forked
from tests.support.jobs import make_job, write_job


def _measure_as_a_peer(cache_dir: str, job_path: str, out: str) -> None:
    """A peer's measurement in a process of its own, as `swarm stage-server` runs it."""
    os.environ["SWARM_CACHE_DIR"] = cache_dir
    torch.set_num_threads(1)
    figures = measure_job(load_job(Path(job_path)), torch.device("cpu"))
    Path(out).write_text(json.dumps(figures))


def test_peers_that_start_together_on_one_machine_measure_once_and_agree(tmp_path: Path) -> None:
    # The CI run above: six peers measured at the same moment on two cores and disagreed 4x on
    # one stage. Peers on one machine now measure one at a time: the first measures, the others
    # wait and read its figures.
    job = write_job(tmp_path, model={"n_layers": 3}, training={"stages": 3})
    # processes of their own, forked from the suite's fork server (torch imported there once)
    ctx = forked.context()
    outs = [tmp_path / f"peer-{i}.json" for i in range(4)]
    peers = [
        ctx.Process(target=_measure_as_a_peer, args=(str(tmp_path / "cache"), str(job), str(o)))
        for o in outs
    ]
    for peer in peers:
        peer.start()
    for peer in peers:
        peer.join(timeout=120)
        assert peer.exitcode == 0
    figures = [json.loads(o.read_text()) for o in outs]
    assert all(f == figures[0] for f in figures), figures
    assert len(figures[0]) == 3 and all(v > 0 for v in figures[0].values())


def test_the_figures_say_they_are_shared_by_the_peers_of_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Peers on one machine all showed the same figure with no word of why: the first measures,
    # the others read its figures from the cache (on purpose: measured one at a time).
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "throughput.json"
    job = make_job(tmp_path, model={"n_layers": 3}, training={"stages": 3})
    caplog.set_level(logging.INFO, logger="stage_server.replica.speed")
    first = measure_job(job, torch.device("cpu"))
    second = measure_job(job, torch.device("cpu"), throttle=2.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "stage_server.replica.speed"]
    figures = str({k: round(v, 1) for k, v in first.items()})
    shared = f"(shared by the peers on this machine, cached {cache})"
    assert lines == [
        f"measured samples/s per stage on cpu: {figures} {shared}",
        f"read samples/s per stage on cpu: {figures} {shared}; --throttle 2.0 divides them",
    ]
    assert second == {k: v / 2.0 for k, v in first.items()}
    assert "stage_server.replica.speed" in LIFECYCLE_LOGGERS  # shown at the default level


def test_an_fp32_and_a_bf16_mixed_job_of_one_shape_are_measured_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 41: the cache key had no precision, so a bf16-mixed job read the figures an fp32 job
    # of its shape had measured (bf16 runs at another speed, far from it on a GPU); nor a
    # device model, so a peer of a machine whose GPU was swapped read the old card's figures.
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "throughput.json"
    model, training = {"n_layers": 2}, {"stages": 2, "dtype": "float32"}
    fp32 = make_job(tmp_path, model=model, training=training)
    bf16 = make_job(tmp_path, model=model, training=training | {"precision": "bf16-mixed"})
    caplog.set_level(logging.INFO, logger="stage_server.replica.speed")
    measure_job(fp32, torch.device("cpu"))
    measure_job(bf16, torch.device("cpu"))
    said = [
        r.getMessage().split()[0] for r in caplog.records if r.name == "stage_server.replica.speed"
    ]
    assert said == ["measured", "measured"], said
    keys = [json.loads(k) for k in json.loads(cache.read_text())]
    assert len(keys) == 4, keys  # two stages, each in both precisions
    for key in keys:
        assert torch.__version__ in key and device_model(torch.device("cpu")) in key, key
    assert len([k for k in keys if "bf16-mixed" in k]) == 2, keys


def test_a_tf32_job_is_measured_apart_from_its_float32_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # TF32 matmuls run on a GPU's tensor cores, at another speed than IEEE float32 ones.
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    model, training = {"n_layers": 2}, {"stages": 2, "dtype": "float32"}
    fp32 = make_job(tmp_path, model=model, training=training)
    tf32 = make_job(tmp_path, model=model, training=training | {"tf32": True})
    caplog.set_level(logging.INFO, logger="stage_server.replica.speed")
    measure_job(fp32, torch.device("cpu"))
    measure_job(tf32, torch.device("cpu"))
    said = [
        r.getMessage().split()[0] for r in caplog.records if r.name == "stage_server.replica.speed"
    ]
    assert said == ["measured", "measured"], said


def test_a_measuring_lock_held_too_long_is_said_and_waited_for_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Another peer's measurement that never ends (hung, or stopped in a debugger) held this
    # one's without a bound and without a word: its agent showed "measuring" for good, and
    # its stop waited on the thread that waited on the lock, past every signal but SIGKILL.
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(speed, "LOCK_WAIT_S", 0.3)
    caplog.set_level(logging.WARNING, logger="stage_server.replica.speed")
    job = make_job(tmp_path, model={"n_layers": 2}, training={"stages": 2})
    lock = speed.cache_path().with_name("throughput.cpu0.lock")
    lock.parent.mkdir(parents=True)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open of it: a lock apart, as a process's
    try:
        figures = measure_job(job, torch.device("cpu"))
    finally:
        os.close(holder)
    assert sorted(figures) == [0, 1] and all(v > 0 for v in figures.values())
    said = [r.getMessage() for r in caplog.records]
    assert any(str(lock) in s and "another stage server" in s for s in said), said
    assert any("measuring without it" in s for s in said), said


def test_the_cache_keeps_the_figures_used_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key per model shape ever measured stayed, the whole file read and written at each
    take-up: it keeps the `KEPT_MEASURES` used last, this job's among them."""
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(speed, "KEPT_MEASURES", 4)
    monkeypatch.setattr(speed, "measure_stage", lambda job, stage, device: 7.0)
    speed.cache_path().parent.mkdir(parents=True)
    speed.cache_path().write_text(json.dumps({f"old{i}": 1.0 for i in range(10)}))
    job = make_job(tmp_path, training={"stages": 2})
    assert measure_job(job, torch.device("cpu")) == {0: 7.0, 1: 7.0}
    kept = json.loads(speed.cache_path().read_text())
    assert len(kept) == 4 and list(kept)[:2] == ["old8", "old9"]
    assert list(kept.values())[2:] == [7.0, 7.0]
