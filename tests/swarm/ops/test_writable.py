"""A directory a role keeps its state in, unusable, is said at start in one line naming the flag,
and the process exits 2 (issue 56, item 4: in a container, a volume the image's user cannot
write). Before, the scheduler's --checkpoint-dir and a stage server's cache directory each ended
in a traceback (the scheduler's after its broker had started). Root writes anywhere, so these run
on a path under a file; tests/system/test_container.py runs the permission case in the image."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.errors import ConfigError
from swarm.ops.writable import writable_dir
from tests.support.cli import swarm


def test_a_directory_that_cannot_be_made_is_a_config_error_naming_the_flag(
    tmp_path: Path,
) -> None:
    assert writable_dir(tmp_path / "a" / "b", "--x") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--checkpoint-dir '.*/file/ckpt': cannot write there"):
        writable_dir(tmp_path / "file" / "ckpt", "--checkpoint-dir")


def test_the_scheduler_and_a_stage_server_say_it_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "data").mkdir()
    bad = tmp_path / "file" / "state"
    done = swarm(
        *("scheduler", "--host", "127.0.0.1", "--port", "0", "--broker-port", "0"),
        *("--data-root", str(tmp_path / "data"), "--store", str(tmp_path / "jobs.sqlite")),
        *("--checkpoint-dir", str(bad)),
        check=False,
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(said) == 1, said
    assert said[0].startswith(f"swarm scheduler: error: --checkpoint-dir '{bad}': cannot write")
    done = swarm(
        *("stage-server", "--broker", "mqtt://127.0.0.1:1", "--port", "0", "--device", "cpu"),
        env={"SWARM_CACHE_DIR": str(bad)},
        check=False,
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(said) == 1, said
    assert said[0].startswith(f"swarm stage-server: error: SWARM_CACHE_DIR '{bad}': cannot write")
