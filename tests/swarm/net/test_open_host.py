"""A scheduler or stage server that listens beyond this machine (`--host 0.0.0.0`, or any
address but loopback) without a token would let anyone who reaches its port in: it is refused
at start, naming the fix, unless `--insecure-no-token` says it is meant (N18). On loopback, as
`swarm demo` and the tests run, no token is needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.net.tokens import refuse_open_host
from tests.support.cli import swarm

pytestmark = pytest.mark.attack("N18")

NO_TOKEN = {"SWARM_TOKEN": "", "SWARM_INSECURE_NO_TOKEN": ""}


def _scheduler(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "data").mkdir(exist_ok=True)
    return [
        "scheduler",
        *("--host", "0.0.0.0", "--port", "0", "--store", str(tmp_path / "jobs.sqlite")),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(tmp_path / "data")),
        *extra,
    ]


def _refused(result_stderr: str) -> str:
    errors = [line for line in result_stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result_stderr
    return errors[0]


def test_a_scheduler_on_every_interface_without_a_token_is_refused(tmp_path: Path) -> None:
    done = swarm(*_scheduler(tmp_path), env=NO_TOKEN, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    error = _refused(done.stderr)
    assert "--host 0.0.0.0" in error and "--token" in error and "SWARM_TOKEN" in error, error
    assert "--insecure-no-token" in error, error
    assert not (tmp_path / "jobs.sqlite").exists()  # refused before anything was made


def test_insecure_no_token_lets_it_start_open(tmp_path: Path) -> None:
    # It passes the token check; the next one (no --announce-host) stops it, without a wait.
    args = _scheduler(tmp_path, "--insecure-no-token")
    done = swarm(*args, env=NO_TOKEN, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "would announce an address nobody can dial" in done.stderr, done.stderr
    assert "SWARM_TOKEN" not in done.stderr


def test_a_stage_server_on_every_interface_without_a_token_is_refused(tmp_path: Path) -> None:
    args = ("stage-server", "--host", "::", "--broker", "mqtt://127.0.0.1:1")
    done = swarm(*args, env=NO_TOKEN, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    error = _refused(done.stderr)
    assert "--host ::" in error and "SWARM_TOKEN" in error and "--insecure-no-token" in error


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    refuse_open_host("the scheduler", host, token=None, insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "203.0.113.7", "node-3"])
def test_any_other_host_needs_a_token_or_the_insecure_switch(host: str) -> None:
    with pytest.raises(ConfigError, match="--insecure-no-token"):
        refuse_open_host("the scheduler", host, token=None, insecure=False)
    refuse_open_host("the scheduler", host, token="t", insecure=False)
    refuse_open_host("the scheduler", host, token=None, insecure=True)
