"""bench/wan.py's torch control (issue 69's 100 Mbit/s target), without root: the ranks' command
lines (rank k on stage k's host, all meeting at rank 0's address, rank 0 logging the steps),
the options it refuses, and its figures on canned runs: each schedule's shaped/unshaped, the
faster schedule on each link, swarm/torch on each link, and the printed table; the job that
`--checkpoint-every` writes. Also bench/torch_pipeline.py's one-rank mode, run for real on
loopback (slow: four processes)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import time_to_loss
import wan

from bench import torch_pipeline
from tests.support import ports

ROOT = Path(__file__).resolve().parents[1]


def test_each_rank_runs_on_its_stages_host_and_meets_rank_0() -> None:
    job, log = Path("/w/job.toml"), Path("/w/steps.jsonl")
    argvs = wan.torch_argvs(job, 8, "1f1b", log)
    assert list(argvs) == ["stage0", "stage1", "stage2", "stage3"]
    rank0 = wan.addresses(1)["stage0"]
    assert rank0 == "10.77.0.11"
    for k, argv in enumerate(argvs.values()):
        assert argv[:3] == [sys.executable, str(ROOT / "bench/torch_pipeline.py"), str(job)]
        flags = dict(zip(argv[3::2], argv[4::2], strict=True))
        assert flags == {
            "--steps": "8",
            "--schedule": "1f1b",
            "--threads": "1",
            "--rank": str(k),
            "--address": rank0,
            "--port": str(wan.TORCH_PORT),
            "--step-log": str(log),
        }
    env = wan.torch_env(Path("/w"))
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["OMP_NUM_THREADS"] == "1"


def test_a_rank_without_a_step_log_or_a_port_is_told() -> None:
    argv = torch_pipeline.rank_argv(Path("j.toml"), 2, "127.0.0.1", 1234, 5)
    assert "--step-log" not in argv and argv[argv.index("--port") + 1] == "1234"
    assert torch_pipeline.init_method("10.77.0.11", 29500) == "tcp://10.77.0.11:29500"
    with pytest.raises(SystemExit) as exited:
        torch_pipeline.main(["j.toml", "--rank", "1"])
    assert exited.value.code == 2


def test_the_schedules_and_the_options_the_control_refuses() -> None:
    assert wan.parse_args([]).torch_schedule == ["gpipe", "1f1b"]
    assert wan.parse_args([]).control == "none"
    assert wan.parse_args(["--torch-schedule", "1f1b"]).torch_schedule == ["1f1b"]
    for bad in ["pipedream", "gpipe,gpipe", ""]:
        with pytest.raises(SystemExit):
            wan.parse_args(["--torch-schedule", bad])
    assert wan.refused(wan.parse_args(["--control", "torch"])) is None
    many = wan.refused(wan.parse_args(["--control", "torch", "--replicas", "2"]))
    assert many is not None and "--replicas 1" in many
    delayed = wan.refused(wan.parse_args(["--control", "torch", "--delay-ms", "20"]))
    assert delayed is not None and "--delay-ms 0" in delayed
    assert wan.refused(wan.parse_args(["--replicas", "2", "--delay-ms", "20"])) is None


def test_time_to_loss_asks_wan_with_every_option_it_reads() -> None:
    # its probe lacked `standby`: as root, wan.check raised AttributeError past the root check
    problem = time_to_loss.check_root()
    assert problem is None or isinstance(problem, str)


def measured(samples_per_s: float, stage1_sent: float = 2.2e6) -> wan.Measured:
    """10 timed steps of the d256 workload (64 samples a step) at `samples_per_s`."""
    seconds = 640 / samples_per_s
    hosts = {h: {"sent": 1e3, "received": 1e3} for h in wan.addresses(1)}
    hosts["stage1"] = {"sent": stage1_sent, "received": stage1_sent}
    return wan.Measured(
        samples_per_s=samples_per_s,
        seconds=seconds,
        steps=10,
        microbatches=80,
        trainer_samples_per_s=samples_per_s * 1.01,
        blocked_seconds_per_step=0.0,
        bytes_per_microbatch=hosts,
        cpu_seconds_per_step={h: 1.0 for h in hosts},
    )


def canned() -> tuple[wan.Measured, wan.Measured, dict[str, dict[str, wan.Measured]]]:
    torch = {
        "gpipe": {"unshaped": measured(28.0), "shaped": measured(21.0, 2.3e6)},
        "1f1b": {"unshaped": measured(30.0), "shaped": measured(20.0, 2.3e6)},
    }
    return measured(28.5), measured(24.0), torch


def test_the_control_is_held_against_torchs_faster_schedule_on_each_link() -> None:
    unshaped, shaped, torch = canned()
    got = wan.control_figures({"unshaped": unshaped, "shaped": shaped}, torch)
    assert got["schedules"]["gpipe"]["shaped_over_unshaped"] == pytest.approx(0.75)
    assert got["schedules"]["1f1b"]["shaped_over_unshaped"] == pytest.approx(20 / 30)
    assert got["best"] == {
        "unshaped": {"schedule": "1f1b", "samples_per_s": 30.0},
        "shaped": {"schedule": "gpipe", "samples_per_s": 21.0},
    }
    assert got["shaped_over_unshaped"] == pytest.approx(0.7)
    assert got["swarm_over_torch"] == pytest.approx({"unshaped": 0.95, "shaped": 24 / 21})
    assert got["swarm_added_seconds_per_step"] == pytest.approx(64 / 24 - 64 / 28.5)
    assert got["schedules"]["gpipe"]["added_seconds_per_step"] == pytest.approx(64 / 21 - 64 / 28)


def test_the_report_carries_the_control_and_prints_it_beside_the_swarm() -> None:
    args = wan.parse_args(["--control", "torch", "--steps", "10"])
    assert wan.refused(args) is None  # sets the rate's bits
    unshaped, shaped, torch = canned()
    r = wan.report(args, unshaped, shaped, torch)
    assert r["torch"]["shaped_over_unshaped"] == pytest.approx(0.7)
    assert json.loads(json.dumps(r))["torch"]["best"]["shaped"]["schedule"] == "gpipe"
    assert wan.report(args, unshaped, shaped)["torch"] is None
    out = io.StringIO()
    wan.print_report(r, out)
    lines = out.getvalue().splitlines()
    assert (
        "shaped/unshaped: swarm 0.842; torch gpipe 0.750, 1f1b 0.667; torch's faster on each "
        "link 0.700" in lines
    )
    assert (
        "swarm/torch (torch's faster schedule on each link): unshaped 0.950 (1f1b), shaped "
        "1.143 (gpipe)" in lines
    )
    assert "s/step the links add: swarm +0.42; torch gpipe +0.76, 1f1b +1.07" in lines
    bound = next(i for i, line in enumerate(lines) if line.startswith("shaped/bound"))
    stage1 = next(line for line in lines[bound:] if line.startswith("stage1 "))  # the control's
    assert stage1.split() == ["stage1", *["2.200", "MB"] * 2, *["2.300", "MB"] * 4]


@pytest.mark.slow
def test_one_rank_at_a_time_meets_at_rank_0_and_logs_each_step(tmp_path: Path) -> None:
    """bench/torch_pipeline.py's ranks started one by one (as wan.py starts them, here on
    loopback): rank 0's step log has a line a step, with the samples and seconds a trainer's
    `--log` has."""
    job = tmp_path / "job.toml"
    job.write_text(wan.job_toml("tiny", 3, "none", "push"))
    log, port = tmp_path / "steps.jsonl", ports.free_port()  # not one the kernel hands out
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    ranks = [
        subprocess.Popen(
            torch_pipeline.rank_argv(job, k, "127.0.0.1", port, 3, "gpipe", 1, log),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(wan.STAGES)
    ]
    try:
        outs = [rank.communicate(timeout=600)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert [rank.returncode for rank in ranks] == [0] * wan.STAGES, outs
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    p = wan.WORKLOADS["tiny"]
    assert all(s["samples"] == p["microbatch_size"] * p["microbatches"] for s in steps)
    assert all(s["seconds"] > 0 for s in steps)
    assert float(outs[0].split()[-1]) > 0  # rank 0's samples/s, its last line as before


def test_checkpoint_every_sets_the_jobs_checkpoints_and_the_trainers_folder(
    tmp_path: Path,
) -> None:
    """`--checkpoint-every N`: the job checkpoints every N steps (a valid job file), which the
    trainer's `--checkpoint-dir` writes; without it, never."""
    from swarm.job.config import load_job

    for every in (0, 2):
        job = tmp_path / f"job-{every}.toml"
        job.write_text(wan.job_toml("tiny", 4, "none", "push", checkpoint_every=every))
        assert load_job(job).training.checkpoint_every == every
    assert wan.parse_args(["--checkpoint-every", "2"]).checkpoint_every == 2
    assert wan.parse_args([]).checkpoint_every == 0
    # refused before any namespace or process is made, with the job's own words
    told = wan.refused(wan.parse_args(["--checkpoint-every", "-1"]))
    assert told is not None and "checkpoint_every" in told, told
