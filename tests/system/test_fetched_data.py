"""A friend's trainer has no shared path (issue 51, item 6): the job's data file lies under the
scheduler's data root, and the friend's trainer, given nothing but an invite (`swarm trainer
--join FILE`: the scheduler, the broker, the token), runs where that directory is empty (its own
mount namespace, a tmpfs over it: another machine, as far as files go). It fetches the file from
the scheduler (FetchData, with the invite's token), keeps it in its cache by the sha256 pinned at
submit, and trains the job to `swarm local`'s parameters. Before, it stopped at start: the data
file was not there (and `swarm trainer` took no --join)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.local.procs import start_local_swarm
from tests.support.cli import ROOT, swarm
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or sys.platform != "linux",
    reason="needs unshare(1) for a mount namespace of its own",
)


def test_a_trainer_without_the_data_path_fetches_the_data_from_the_scheduler(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "examples" / "data" / "corpus.txt", data / "corpus.txt")
    job = write_job(
        data,
        model={"vocab_size": 256},
        data={"kind": "text", "path": "corpus.txt"},
        training={"stages": 2, "steps": 4, "target_batch_size": 16},
    )
    token = tmp_path / "token"
    token.write_text("a-swarm-token-of-32-characters-or-more\n")
    token.chmod(0o600)
    ours = {"SWARM_TOKEN_FILE": str(token)}
    sw, _ = start_local_swarm(
        [20.0] * 2,
        log_dir=tmp_path,
        data_root=data,
        extra_scheduler=["--no-embedded-trainer"],
        env=ours,
    )
    cache, log = tmp_path / "friend-cache", tmp_path / "friend-trainer.log"
    invite = tmp_path / "friend.invite.json"
    try:
        job_id = swarm("submit", str(job), "--scheduler", sw.address, env=ours).stdout.split()[0]
        where = ["--broker", sw.broker, "--scheduler", sw.address]
        swarm("invite", "friend", *where, "--token-file", str(token), "--out", str(invite))
        # The friend's machine: the data root's directory is there, empty.
        hide = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, str(data)]
        argv = [
            sys.executable,
            "-m",
            "swarm.cli",
            "--log-level",
            "INFO",
            "trainer",
            "--join",
            str(invite),
        ]
        with open(log, "wb") as out:
            done = subprocess.run(
                [*unshare, *argv, "--job", job_id],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SWARM_CACHE_DIR": str(cache)},  # the invite's token only
                cwd=ROOT,
                timeout=300,
            )
        said = log.read_text()
        assert done.returncode == 0, said[-3000:]
        assert "data.path" in said and "fetching it from the scheduler" in said, said[-3000:]
        address = ("--scheduler", sw.address)
        swarm("export", job_id, "--out", str(tmp_path / "swarm.pt"), *address, env=ours)
        status = swarm("status", job_id, "--json", *address, env=ours).stdout
    finally:
        sw.stop()
    [kept] = (cache / "data").iterdir()
    assert kept.read_bytes() == (data / "corpus.txt").read_bytes()
    assert kept.name in status  # named by the sha256 the scheduler pinned
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)
