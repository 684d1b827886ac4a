"""The client commands against a real job API server: exit codes, messages, outputs.

The commands run `asyncio.run` themselves, so they run on a worker thread while the test's event
loop serves the API; capsys captures both threads' output."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from scheduler.job_api import LIST_PAGE_SIZE
from swarm.cli import load, parse
from swarm.flags import env_name
from swarm.job.config import load_job
from swarm.model.transformer import build_model
from tests.support.api import RunningApi
from tests.support.disks import fill, tiny_disk
from tests.support.jobs import write_job
from tests.support.ports import free_address


async def swarm(*argv: str, env: dict[str, str] | None = None) -> int:
    """`swarm ARGV` as `swarm.cli` parses and runs it; of the `SWARM_<FLAG>` variables, only
    `env`'s are set while it parses (`{"scheduler": ADDR}` sets SWARM_SCHEDULER)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    environ |= {env_name(flag): value for flag, value in (env or {}).items()}
    with mock.patch.dict(os.environ, environ, clear=True):
        args = parse(list(argv))
    return int(await asyncio.to_thread(load(args.command).run, args.command, args))


async def test_submit_status_jobs_cancel(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at = ("--scheduler", api.address)
    assert await swarm("submit", str(write_job(tmp_path, "idle")), *at) == 0
    job = capsys.readouterr().out.strip()
    assert job.startswith("idle-")
    assert await swarm("status", job, *at) == 0
    out = capsys.readouterr().out
    assert "state    queued" in out and "step     0/3" in out and "peer-a" in out
    assert await swarm("status", job, "--json", env={"scheduler": api.address}) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"] == job and doc["state"] == "JOB_STATE_QUEUED"
    assert doc["samples_per_second"] == 12.5 and doc["loss"] == "NaN"
    assert doc["stages"][0]["replicas"][0]["peer"] == "peer-a"
    assert await swarm("jobs", *at) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["JOB", "NAME", "STATE"] and lines[1].startswith(job)
    assert await swarm("cancel", job, *at) == 0
    assert f"job {job} cancelled" in capsys.readouterr().out
    assert await swarm("cancel", job, *at) == 1  # finished: refused, but not bad input
    assert "swarm cancel: error: job" in capsys.readouterr().err


async def test_submit_wait(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at = ("--scheduler", api.address, "--poll", "0.01")
    assert await swarm("submit", str(write_job(tmp_path, "run")), "--wait", *at) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("run-") and "succeeded: 3 steps, loss 2.0000" in captured.out
    assert "3/3" in captured.err  # the progress bar's last state
    # The job's events and what it says it does are printed above the bar as they come.
    assert " peer-a joined stage 0\n" in captured.err and " succeeded: 3 steps\n" in captured.err
    assert "succeeded: done" not in captured.err  # the end is said once (and printed below)
    assert await swarm("submit", str(write_job(tmp_path, "doomed")), "--wait", *at) == 1
    err = capsys.readouterr().err
    assert "swarm submit: error: job doomed-" in err and "stage 1 lost every replica" in err


async def test_bad_job_file(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_job(tmp_path, training={"dtype": "float16"})
    assert await swarm("submit", str(path), "--scheduler", api.address) == 2
    err = capsys.readouterr().err
    assert err.startswith("swarm submit: error: training.dtype") and api.store.list() == []
    assert await swarm("submit", str(tmp_path / "missing.toml"), "--scheduler", api.address) == 2
    assert "cannot be read" in capsys.readouterr().err


async def test_unknown_job(api: RunningApi, capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("status", "cancel"):
        assert await swarm(cmd, "nope", "--scheduler", api.address) == 2
        err = capsys.readouterr().err
        assert err == f"swarm {cmd}: error: unknown job 'nope'; `swarm jobs` lists them\n"
    # A refusal is no outage: the watch ends at once.
    assert await swarm("status", "nope", "--watch", "--scheduler", api.address) == 2
    assert "unknown job 'nope'" in capsys.readouterr().err


async def test_no_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    address = free_address()
    assert await swarm("jobs", "--scheduler", address) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"swarm jobs: error: cannot reach the scheduler at {address}")
    assert await swarm("jobs") == 2  # no --scheduler, no SWARM_SCHEDULER
    assert "pass --scheduler HOST:PORT or set SWARM_SCHEDULER" in capsys.readouterr().err
    # A view asks again for --retry-for, saying so, then gives up.
    assert await swarm("status", "j-1", "--watch", "--retry-for", "1", "--scheduler", address) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("scheduler unreachable since ")
    assert captured.err.startswith(f"swarm status: error: cannot reach the scheduler at {address}")
    assert captured.err.endswith("; no answer for 1s (--retry-for): giving up\n")


async def test_export(api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = api.store.create("exp", "", "/", 3).id
    out = tmp_path / "model.pt"
    assert await swarm("export", job, "--out", str(out), "--scheduler", api.address) == 0
    assert "after 7 steps" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in api.control.state.items())
    bad_dir = tmp_path / "no" / "such" / "dir" / "model.pt"
    assert await swarm("export", job, "--out", str(bad_dir), "--scheduler", api.address) == 1
    assert "swarm export: error: cannot write" in capsys.readouterr().err


async def test_export_as_a_hugging_face_checkpoint(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    path = write_job(tmp_path, "llama", model={"kind": "llama", "n_heads": 4, "n_kv_heads": 1})
    job = load_job(path)
    model = build_model(job)
    api.control.state = model.state_dict()
    job_id = api.store.create("llama", path.read_text(), str(tmp_path), 3).id
    out, at = tmp_path / "hf", ("--scheduler", api.address)
    argv = ("export", job_id, "--out", str(out), "--format", "hf", "--dtype", "float32", *at)
    assert await swarm(*argv) == 0
    assert "after 7 steps" in capsys.readouterr().out
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).float(), rtol=0, atol=1e-5)
    assert await swarm(*argv) == 1  # it is there now: not overwritten, nor mixed with
    assert "exists and is not an empty directory" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["torch", "hf"])
async def test_an_export_to_a_full_disk_is_one_line(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    """The disk fills as the weights are written, after the download: safetensors fails with
    its own error class, not an OSError, and `--format hf` was a traceback (a review found it);
    torch writes through the file object, whose OSError is said."""
    path = write_job(tmp_path, "llama", model={"kind": "llama", "n_heads": 4, "n_kv_heads": 1})
    api.control.state = build_model(load_job(path)).state_dict()
    job = api.store.create("llama", path.read_text(), str(tmp_path), 3).id
    with tiny_disk(tmp_path / "disk") as disk:
        filler = fill(disk)
        os.truncate(filler, filler.stat().st_size - 16384)  # room for config.json, not weights
        out = disk / ("hf" if form == "hf" else "model.pt")
        argv = ("export", job, "--out", str(out), "--format", form, "--scheduler", api.address)
        assert await swarm(*argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"swarm export: error: cannot write {out} ("), err
        assert "No space left on device" in err and "Traceback" not in err, err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # nothing half written


async def test_status_watch_follows_a_job_to_its_end(
    api: RunningApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at = ("--scheduler", api.address)
    job_file = write_job(tmp_path, "run-watch", training={"steps": 20})
    assert await swarm("submit", str(job_file), *at) == 0
    job = capsys.readouterr().out.strip()
    assert await swarm("status", job, "--watch", "--interval", "0.05", *at) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a terminal: plain frames, one per change
    # The job's own history, from the start (the fake control records what the scheduler does).
    assert "step     20/20" in out and " peer-a joined stage 0\n" in out
    assert out.split("recent events:\n")[-1].splitlines()[1].endswith(" succeeded: 20 steps")
    assert f"job {job} succeeded: 20 steps" in out
    with pytest.raises(SystemExit) as refused:  # one view or the other
        await swarm("status", job, "--watch", "--json", *at)
    assert refused.value.code == 2


async def test_jobs_follows_the_pages_and_delete(
    api: RunningApi, capsys: pytest.CaptureFixture[str]
) -> None:
    at = ("--scheduler", api.address)
    ids = [api.store.create("many", "", "/", 3).id for _ in range(LIST_PAGE_SIZE + 3)]
    assert await swarm("jobs", *at) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ids[::-1]  # every page, newest first
    job = ids[0]
    assert await swarm("delete", job, *at) == 1  # queued: refused, but not bad input
    assert f"swarm delete: error: job '{job}' is queued; cancel it first" in capsys.readouterr().err
    assert await swarm("cancel", job, *at) == 0
    assert await swarm("delete", job, *at) == 0
    assert f"job {job} deleted" in capsys.readouterr().out and api.store.get(job) is None
    assert await swarm("delete", job, *at) == 2
    assert "unknown job" in capsys.readouterr().err


def test_a_scheduler_trainer_refuses_what_only_a_trainer_of_its_own_servers_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out` and `--log` were taken under a scheduler and nothing was written, nor said (a
    review found it); `--checkpoint-dir` and `--routes` the same."""
    from swarm.cli import main

    argv = ["trainer", "--scheduler", "127.0.0.1:1", "--job", "j-1"]
    asked = ["--out", str(tmp_path / "m.pt"), "--log", str(tmp_path / "steps.jsonl")]
    assert main([*argv, *asked]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swarm trainer: error: --out, --log: only with --stage-servers;"), err
    assert "swarm export JOB --out FILE" in err
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "steps.jsonl").exists()
