"""Secrets on the command line show in `ps` to every local user (N19): each secret flag has a
`-file` twin and a variable, and one given on the command line itself still works but is warned
of, once, naming those."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarm.bus.flags import add_login_flags, scheduler_token
from swarm.flags import (
    add_flag,
    add_metrics_token,
    add_token,
    metrics_token,
    token,
    warn_if_url_password,
)
from tests.support.cli import swarm

pytestmark = pytest.mark.attack("N19")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_token(p)
    add_metrics_token(p)
    add_login_flags(p)
    return p


@pytest.fixture(autouse=True)
def _no_secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TOKEN", "METRICS_TOKEN", "SCHEDULER_TOKEN"):
        monkeypatch.delenv(f"SWARM_{name}", raising=False)
        monkeypatch.delenv(f"SWARM_{name}_FILE", raising=False)


READERS = [("token", token), ("metrics-token", metrics_token), ("scheduler-token", scheduler_token)]


@pytest.mark.parametrize(("flag", "read"), READERS)
def test_a_secret_is_read_from_its_file_without_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, read: object
) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    args = _parser().parse_args([f"--{flag}-file", str(path)])
    assert read(args) == "s3cret"  # type: ignore[operator]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("flag", "read"), READERS)
def test_a_secret_on_the_command_line_works_and_is_warned_of_once(
    capsys: pytest.CaptureFixture[str], flag: str, read: object
) -> None:
    args = _parser().parse_args([f"--{flag}", "s3cret"])
    assert read(args) == "s3cret"  # type: ignore[operator]
    assert read(args) == "s3cret"  # type: ignore[operator]
    warned = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warned) == 1, warned
    assert f"--{flag}" in warned[0] and "ps" in warned[0], warned
    assert f"--{flag}-file" in warned[0] and "SWARM_" in warned[0], warned
    assert "s3cret" not in warned[0]


def test_a_missing_or_empty_secret_file_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").write_text("\n")
    for path, why in ((tmp_path / "none"), "cannot read it"), ((tmp_path / "empty"), "empty"):
        with pytest.raises(SystemExit) as stopped:
            token(_parser().parse_args(["--token-file", str(path)]))
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert f"--token-file {path}" in error and why in error, error


def test_the_file_is_named_by_its_variable_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t").write_text("from-file")
    monkeypatch.setenv("SWARM_TOKEN_FILE", str(tmp_path / "t"))
    assert token(_parser().parse_args([])) == "from-file"


def test_a_real_command_warns_of_a_token_on_its_command_line(tmp_path: Path) -> None:
    # A server on every interface with a token passes N18's check; the missing --announce-host
    # then stops it at once: the warning came first.
    (tmp_path / "data").mkdir()
    args = ["scheduler", "--host", "0.0.0.0", "--port", "0", "--token", "s3cret"]
    args += ["--store", str(tmp_path / "s.sqlite"), "--data-root", str(tmp_path / "data")]
    args += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    done = swarm(*args, env={"SWARM_TOKEN": ""}, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--token-file" in done.stderr and "s3cret" not in done.stderr, done.stderr


def test_a_broker_password_on_the_command_line_is_warned_of(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "mqtts://gpu1:pa55word@broker.example.org:8883"
    p = argparse.ArgumentParser()
    add_flag(p, "broker", None, "MQTT broker URL")
    monkeypatch.delenv("SWARM_BROKER", raising=False)
    warn_if_url_password(p.parse_args(["--broker", url]), "broker")
    warned = capsys.readouterr().err
    assert "--broker" in warned and "SWARM_BROKER" in warned and "pa55word" not in warned
    warn_if_url_password(p.parse_args(["--broker", "mqtts://broker.example.org"]), "broker")
    monkeypatch.setenv("SWARM_BROKER", url)  # from the environment: not in `ps`
    warn_if_url_password(p.parse_args([]), "broker")
    assert capsys.readouterr().err == ""


def test_a_secret_file_gives_its_first_line(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n# the old one, kept for a day: 0ld\n")
    args = _parser().parse_args(["--token-file", str(path)])
    assert token(args) == "s3cret"


def test_a_secret_file_that_is_not_text_stops_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"\xff\xfe\x00binary")
    args = _parser().parse_args(["--token-file", str(path)])
    with pytest.raises(SystemExit) as exit_:
        token(args)
    assert exit_.value.code == 2
    assert f"--token-file {path}: it is not text" in capsys.readouterr().err
