"""What the `swarm` commands say about themselves and leave behind: each flag's default shown
once in `--help`, the environment variable each flag reads (one per role for `--port`), a clear
error for `swarm generate` given a file, and exported files with the user's usual modes."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from unittest import mock

import pytest

from swarm.cli import COMMANDS, load, main, parse
from swarm.job.config import load_job
from swarm.model.hf import write_hf
from swarm.model.transformer import build_model
from tests.support.api import RunningApi
from tests.support.jobs import write_job


@pytest.fixture
def clean_env() -> Iterator[MutableMapping[str, str]]:
    """The environment without any SWARM_ variable; the test sets its own in it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    with mock.patch.dict(os.environ, environ, clear=True):
        yield os.environ


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """`swarm COMMAND --help`, one entry per option: its first flag -> its help, one line."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", text):
        flag = block.split()[0].rstrip(",")
        entries[flag] = " ".join(block.split())
    return entries


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_default_once(
    command: str, clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    for help in _help(command, capsys).values():
        assert help.lower().count("default") <= 1, help
        for empty in ("(default: None)", "(default: )", "(default: False)"):
            assert empty not in help, help


def test_every_job_command_names_the_scheduler_variable(
    clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("submit", "status", "jobs", "cancel", "delete", "export", "trainer"):
        assert "[env SWARM_SCHEDULER]" in _help(command, capsys)["--scheduler"], command
    clean_env["SWARM_SCHEDULER"] = "sched.example.org:7700"
    assert parse(["jobs"]).scheduler == "sched.example.org:7700"


def test_each_role_reads_a_port_variable_of_its_own(
    clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    # One shell may start a scheduler and a stage server: one SWARM_PORT would bind both to it.
    ports = {"scheduler": 7701, "stage-server": 7702, "broker": 7703}
    clean_env["SWARM_SCHEDULER_PORT"] = "7701"
    clean_env["SWARM_STAGE_SERVER_PORT"] = "7702"
    clean_env["SWARM_BROKER_PORT"] = "7703"
    for command, port in ports.items():
        assert parse([command]).port == port, command
    assert parse(["scheduler"]).broker_port == 7703  # the broker's port, whoever runs it
    capsys.readouterr()
    clean_env["SWARM_PORT"] = "9999"  # read by none; each says so rather than ignore it quietly
    assert parse(["stage-server"]).port == 7702
    assert "SWARM_PORT is not read; this command reads SWARM_STAGE_SERVER_PORT" in (
        capsys.readouterr().err
    )
    # The same for the metrics port: a scheduler and a stage server in one shell.
    clean_env["SWARM_SCHEDULER_METRICS_PORT"] = "9101"
    clean_env["SWARM_STAGE_SERVER_METRICS_PORT"] = "9102"
    clean_env["SWARM_TRAINER_METRICS_PORT"] = "9103"
    roles = (["scheduler"], ["stage-server"], ["trainer", "--job", "j.toml"])
    got = {argv[0]: parse(argv).metrics_port for argv in roles}
    assert got == {"scheduler": 9101, "stage-server": 9102, "trainer": 9103}


def test_generate_given_a_file_names_the_directory_it_needs(
    tmp_path: Path, clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.pt"
    model.write_bytes(b"a torch state_dict")
    assert main(["generate", str(model), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert f"{model} is a file: give a Hugging Face checkpoint directory" in err, err
    assert "swarm export JOB --format hf --out DIR" in err and "Not a directory" not in err
    assert main(["generate", str(tmp_path), "--prompt", "hello"]) == 2
    assert f"{tmp_path} holds no config.json" in capsys.readouterr().err


@pytest.fixture
def umask() -> Iterator[int]:
    """A umask other than the usual 022, so that a mode that follows it cannot be a constant."""
    before = os.umask(0o027)
    yield 0o027
    os.umask(before)


async def test_exports_get_the_modes_the_umask_gives(
    api: RunningApi, tmp_path: Path, clean_env: MutableMapping[str, str], umask: int
) -> None:
    path = write_job(tmp_path, "llama", model={"kind": "llama", "n_heads": 4, "n_kv_heads": 1})
    api.control.state = build_model(load_job(path)).state_dict()
    job = api.store.create("llama", path.read_text(), str(tmp_path), 3).id
    at = ("--scheduler", api.address)
    hf, pt = tmp_path / "hf", tmp_path / "model.pt"
    for out in (["--out", str(hf), "--format", "hf"], ["--out", str(pt)]):
        args = parse(["export", job, *out, *at])
        assert await asyncio.to_thread(load("export").run, "export", args) == 0
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    assert hf.stat().st_mode & 0o777 == dir_mode  # not mkdtemp's 0700
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*hf.iterdir(), pt]}
    assert modes == {
        "model.safetensors": file_mode,
        "config.json": file_mode,
        "model.pt": file_mode,
    }


def test_status_help_explains_every_line_and_column_of_the_view(
    clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51: "?/3140 Mbit/s" and the other columns were explained nowhere a user looks."""
    from client.live import status_lines
    from swarm.proto import control_pb2 as cpb
    from swarm.proto import scheduler_pb2 as spb

    s = spb.JobStatus(
        job="j-1", name="j", state=cpb.JOB_STATE_FAILED, step=3, steps=9, loss=2.0, val_loss=2.5
    )
    s.message, s.error, s.warnings[:] = "training", "boom", ["a stage has a single replica"]
    s.rounds.CopyFrom(spb.RoundStatus(rule="local", round=1, rounds=3, round_steps=3))
    replica = spb.Replica(peer="p", device="cpu", state=cpb.PEER_STATE_SERVING)
    replica.download_bytes_per_second = 3140e6 / 8
    s.stages.append(spb.StageStatus(stage=0, layers=[0, 1], replicas=[replica]))
    s.events.append(spb.JobEvent(time=1.0, text="p joined stage 0"))
    lines = status_lines(s, now=2.0)
    labels = {line[:9].strip() for line in lines if line[:1].isalpha() and line[:9].strip()}
    labels -= {"stage 0 (", "events:"}
    assert labels == {
        "job",
        "state",
        "step",
        "loss",
        "val loss",
        "speed",
        "rounds",
        "audits",
        "message",
        "error",
        "warning",
    }  # the view's every top line: a new one must be explained too
    header = next(line for line in lines if line.startswith("  PEER")).split()
    assert "?/3140 Mbit/s" in "\n".join(lines)
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    epilog = capsys.readouterr().out.split("what the view shows", 1)[1]
    for label in labels:
        assert re.search(rf"^  {label}  ", epilog, re.M), label
    for column in header:
        assert re.search(rf"^    {re.escape(column)}  ", epilog, re.M), column
    assert "? is a direction not measured yet" in epilog and "events" in epilog


@pytest.mark.parametrize(
    "argv",
    [
        # past ~9.2e9 s gRPC cannot express a deadline: the call failed unsent, "did not answer"
        ["status", "j", "--timeout", "inf"],
        ["status", "j", "--timeout", "1e10"],
        ["jobs", "--timeout", "-1"],
        ["cancel", "j", "--timeout", "nan"],
        # a pause of 0 polled the scheduler in a tight loop
        ["submit", "job.toml", "--wait", "--poll", "0"],
        ["status", "j", "--watch", "--interval", "0"],
    ],
    ids=lambda argv: " ".join(argv[-2:]),
)
def test_a_deadline_or_pause_out_of_range_is_refused_naming_its_flag(
    argv: list[str], clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert f"argument {argv[-2]}: {argv[-1]!r}: a number of seconds > 0 and <= 86400" in err, err


@pytest.mark.parametrize(
    ("variable", "value", "argv"),
    [
        ("SWARM_TIMEOUT", "inf", ["jobs"]),
        ("SWARM_THREADS", "-3", ["trainer", "--job", "j"]),
    ],
)
def test_a_flags_variable_is_held_to_the_flags_own_check(
    variable: str,
    value: str,
    argv: list[str],
    clean_env: MutableMapping[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_env[variable] = value
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"'{value}'" in err, err


@pytest.mark.parametrize(
    ("argv", "least"),
    [
        (["local", "job.toml", "--threads", "-1"], 0),  # torch raised, a traceback
        (["trainer", "--job", "j", "--threads", "0"], 1),
        (["stage-server", "--threads", "-2"], 1),  # clamped to 1 without a word
        (["aggregator", "--threads", "x"], 1),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else str(a),
)
def test_threads_below_their_least_are_refused_naming_the_flag(
    argv: list[str],
    least: int,
    clean_env: MutableMapping[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert f"argument --threads: {argv[-1]!r}: an integer >= {least}" in err, err


def test_a_route_record_that_cannot_be_read_is_said_before_any_training(
    tmp_path: Path, clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    job = write_job(tmp_path, "local", pool={"mode": "local"}, training={"steps": 100000})
    missing = tmp_path / "routes.jsonl"
    # (were the model built and trained first, 100,000 steps would time the test out)
    assert main(["local", str(job), "--threads", "1", "--routes", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--routes {missing}: cannot read it (No such file or directory)" in err, err


def test_generate_on_a_device_this_machine_lacks_says_so(
    tmp_path: Path, clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    job = load_job(write_job(tmp_path, "gen", model={"vocab_size": 256}))
    write_hf(tmp_path / "hf", build_model(job).state_dict(), job.model, None)
    argv = ["generate", str(tmp_path / "hf"), "--prompt", "hi", "--device", "cuda:7"]
    assert main(argv) == 2  # was torch's own error, a traceback
    assert "--device cuda:7" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["2", "-1"])
def test_a_stage_server_asked_for_a_stage_the_job_lacks_says_which_it_has(
    stage: str,
    tmp_path: Path,
    clean_env: MutableMapping[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = write_job(tmp_path, "two", training={"stages": 2})
    # (stage 2 of two indexed the partition first: an IndexError's traceback)
    assert main(["stage-server", "--job", str(job), "--stage", stage, "--port", "0"]) == 2
    assert f"--stage {stage}: the job has stages 0..1" in capsys.readouterr().err


SECRET_FLAGS = ("--token", "--metrics-token", "--scheduler-token", "--admin-token")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_secret_flag_has_its_file_twin(
    command: str, clean_env: MutableMapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/deployment.md: a secret on the command line shows in `ps`; each has a -file flag
    (`swarm broker-config --scheduler-token` had none)."""
    flags = _help(command, capsys)
    for secret in SECRET_FLAGS:
        if secret in flags:
            assert f"{secret}-file" in flags, f"swarm {command} {secret}"
