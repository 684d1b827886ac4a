"""The image, built and run (issue 56): the Containerfile built with podman on a base image made
from Debian's packages (`tests.support.image`, as `make image` builds it), then a scheduler and
four stage servers each in a container of their own (host network, the image's non-root user,
the scheduler's store and checkpoints on a volume), a float64 job trained through a SIGKILL of
one stage server's container, equal to `swarm local` within 1e-9. The trainer runs on the host
and holds still (SIGSTOP) while the test looks, so the kill lands mid-job however fast the
machine is. Also: `swarm health` answers for the scheduler inside its container; a container
stopped with SIGTERM exits 0 (a stage server announced offline, the scheduler's store whole);
stage servers need no shared memory (a 1 MB /dev/shm); a stage server started without the
swarm's token against a scheduler that requires one, a volume the image's user cannot write and
a secret it cannot read each say so in one line and exit non-zero; the fast tests pass inside
the image (its `test` stage).

Skipped, with the reason, only where containers cannot run at all (not root, no podman to be
had). The first build on a fresh machine takes minutes (the base image, torch's wheel); later
ones reuse podman's layers."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm.local.procs import start_process
from swarm.ops.lifecycle import parse_ready
from tests.support import image
from tests.support.cli import ROOT, swarm
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.once import once
from tests.support.ports import free_port
from tests.support.status import job_status
from tests.support.waiting import wait_until_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TAG = "localhost/swarm:test"
UID = 10001  # the image's user (Containerfile): the volumes it writes are its own
RUN_S = 0.3  # the trainer runs this long between two looks (tests/system/test_many_hosts.py)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built once per pytest run, by whichever worker asks first (`once`)."""
    if os.geteuid() != 0:
        pytest.skip("containers here run as root (podman with runc and cgroupfs)")
    try:
        image.ensure_podman()
    except image.Unavailable as e:
        pytest.skip(f"containers cannot run on this host: {e}")
    with once(tmp_path_factory, "image") as (_, first):
        if first:
            image.build(TAG)
    return TAG


class Containers:
    """Containers of one test, named apart (the test's pid), removed at the end."""

    def __init__(self, tag: str) -> None:
        self.tag, self.prefix, self.names = tag, f"swt-{os.getpid()}-", []

    def run(
        self,
        name: str,
        *args: str,
        volumes: dict[Path, str] | None = None,
        options: tuple[str, ...] = (),
    ) -> str:
        """`options`: podman run's own (`--shm-size 1m`)."""
        full = self.prefix + name
        argv = ["run", "-d", "--name", full, "--network", "host", "--ulimit", "host", *options]
        for host, inside in (volumes or {}).items():
            argv += ["--volume", f"{host}:{inside}"]
        image.podman(*argv, self.tag, "--log-level", "INFO", *args)
        self.names.append(full)
        return full

    def logs(self, name: str) -> str:
        done = image.podman("logs", self.prefix + name, check=False)
        return done.stdout + done.stderr

    def running(self, name: str) -> bool:
        state = image.podman("inspect", "--format", "{{.State.Running}}", self.prefix + name)
        return state.stdout.strip() == "true"

    def ready(self, name: str, timeout_s: float = 180) -> dict[str, str]:
        def line() -> dict[str, str] | None:
            found = next(filter(None, map(parse_ready, self.logs(name).splitlines())), None)
            if found is None and not self.running(name):
                raise AssertionError(f"{name} exited before it was ready:\n{self.logs(name)}")
            return found

        return wait_until_blocking(line, f"{name}'s ready line", timeout_s=timeout_s)

    def exit_code(self, name: str) -> int:
        done = image.podman("wait", self.prefix + name, timeout=120)
        return int(done.stdout.strip())

    def remove_all(self) -> None:
        for full in self.names:
            image.podman("rm", "-f", full, check=False)


@pytest.fixture
def containers(built: str) -> Iterator[Containers]:
    made = Containers(built)
    try:
        yield made
    finally:
        made.remove_all()


def _volume(path: Path) -> Path:
    path.mkdir(parents=True)
    os.chown(path, UID, UID)
    return path


def test_a_swarm_of_containers_trains_exactly_through_a_sigkill(
    containers: Containers, tmp_path: Path
) -> None:
    job = write_job(
        tmp_path, training={"stages": 2, "steps": 30, "checkpoint_every": 5}, model={"d_model": 16}
    )
    port, broker = free_port(), free_port()
    scheduler = f"127.0.0.1:{port}"
    volumes = {_volume(tmp_path / "data"): "/data", _volume(tmp_path / "state"): "/checkpoints"}
    containers.run(
        "scheduler",
        "scheduler",
        *("--host", "127.0.0.1", "--port", str(port), "--broker-port", str(broker)),
        *("--data-root", "/data", "--store", "/checkpoints/jobs.sqlite"),
        *("--checkpoint-dir", "/checkpoints/ckpt", "--no-embedded-trainer"),
        volumes=volumes,
    )
    assert containers.ready("scheduler")["address"] == scheduler
    peers = [f"peer{i}" for i in range(4)]
    for peer in peers:
        containers.run(
            peer,
            "stage-server",
            *("--broker", f"mqtt://127.0.0.1:{broker}", "--host", "127.0.0.1", "--port", "0"),
            *("--peer", peer, "--threads", "1"),
            # No shared memory to speak of (docs: its workers are threads of one process, no
            # tensor passes between processes): a 1 MB /dev/shm, far below Docker's 64 MB.
            options=("--shm-size", "1m"),
        )
    for peer in peers:
        containers.ready(peer)
    health = image.podman(
        "exec", containers.prefix + "scheduler", "swarm", "health", "--health-address", scheduler
    )
    assert health.stdout.strip() == f"{scheduler}: SERVING"

    job_id = swarm("submit", str(job), "--scheduler", scheduler).stdout.split()[0]
    # (forked, as the suite starts its swarm processes: `tests.support.forked`)
    trainer = start_process(
        ["trainer", "--scheduler", scheduler, "--job", job_id], log_dir=tmp_path, name="trainer"
    )
    killed, status = None, {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            held = killed is None
            if held:  # the job holds still while the test looks (asked in this process)
                trainer.proc.send_signal(signal.SIGSTOP)
            try:
                status = job_status(scheduler, job_id)
                stages = status.get("stages", [])
                pools = [s["replicas"] for s in stages if len(s.get("replicas", [])) > 1]
                if held and int(status.get("step", 0)) >= 3 and pools:
                    killed = pools[0][0]["peer"]
                    image.podman("kill", "--signal", "KILL", containers.prefix + killed)
            finally:
                if held:
                    trainer.proc.send_signal(signal.SIGCONT)
            if status.get("state") in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"):
                break
            time.sleep(RUN_S)
        assert status.get("state") == "JOB_STATE_SUCCEEDED", status
        assert killed is not None, "no stage had two replicas to kill one of"
        assert containers.exit_code(killed) == 137  # SIGKILLed
        swarm("export", job_id, "--out", str(tmp_path / "swarm.pt"), "--scheduler", scheduler)
    finally:
        trainer.kill()
    assert_equal_to_local(job, torch.load(tmp_path / "swarm.pt"), tol=1e-9)
    # SIGTERM stops a role cleanly: a stage server leaves its pool (it announces itself
    # offline, and the scheduler hears it stopped rather than lost), the scheduler its store.
    for name in [*(p for p in peers if p != killed), "scheduler"]:
        image.podman("stop", "--time", "60", containers.prefix + name, timeout=120)
        assert containers.exit_code(name) == 0, containers.logs(name)[-3000:]
        if name != "scheduler":
            said = containers.logs(name)
            assert "stopped (SIGTERM or SIGINT)" in said and "announced offline" in said, said
    with sqlite3.connect(tmp_path / "state" / "jobs.sqlite") as db:  # whole, and what it said
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = db.execute("SELECT state, step FROM jobs WHERE id = ?", (job_id,)).fetchall()
    assert rows == [("succeeded", 30)], rows


def test_a_stage_server_without_the_token_says_so_and_exits(
    containers: Containers, tmp_path: Path
) -> None:
    secrets = _volume(tmp_path / "secrets")
    token = secrets / "token"
    token.write_text("the-swarm-token\n")
    os.chown(token, UID, UID)
    token.chmod(0o600)
    port, broker = free_port(), free_port()
    containers.run(
        "scheduler",
        "scheduler",
        *("--host", "127.0.0.1", "--port", str(port), "--broker-port", str(broker)),
        *("--data-root", "/data", "--token-file", "/tls/token"),
        volumes={_volume(tmp_path / "data"): "/data", secrets: "/tls:ro"},
    )
    containers.ready("scheduler")
    containers.run("peer", "stage-server", "--broker", f"mqtt://127.0.0.1:{broker}", "--port", "0")
    code = containers.exit_code("peer")
    said = [line for line in containers.logs("peer").splitlines() if line.strip()]
    assert code != 0, said
    assert any("token" in line.lower() for line in said[-3:]), said


def test_a_volume_the_image_user_cannot_write_is_said_in_one_line(
    containers: Containers, tmp_path: Path
) -> None:
    """The scheduler's checkpoints and a stage server's cache on volumes the host's root owns
    (the image's user is uid 10001): each says so in one line at start and exits 2."""
    state, cache = tmp_path / "state", tmp_path / "cache"
    state.mkdir(mode=0o755)
    cache.mkdir(mode=0o755)
    port, broker = free_port(), free_port()
    containers.run(
        "scheduler",
        "scheduler",
        *("--host", "127.0.0.1", "--port", str(port), "--broker-port", str(broker)),
        *("--data-root", "/data", "--store", "/tmp/jobs.sqlite", "--checkpoint-dir", "/ckpt"),
        volumes={_volume(tmp_path / "data"): "/data", state: "/ckpt"},
    )
    containers.run(
        "peer",
        "stage-server",
        *("--broker", f"mqtt://127.0.0.1:{broker}", "--port", "0"),
        volumes={cache: "/cache"},
    )
    for name, what in (("scheduler", "--checkpoint-dir '/ckpt'"), ("peer", "'/cache'")):
        assert containers.exit_code(name) == 2
        said = [line for line in containers.logs(name).splitlines() if line.strip()]
        assert len(said) == 1 and what in said[0] and "cannot write there" in said[0], said


def test_a_secret_the_image_user_cannot_read_is_said_in_one_line(
    containers: Containers, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)  # root's: the image's user cannot enter it
    (secrets / "token").write_text("the-swarm-token\n")
    containers.run(
        "scheduler",
        "scheduler",
        *("--host", "127.0.0.1", "--port", str(free_port()), "--broker-port", str(free_port())),
        *("--data-root", "/data", "--token-file", "/tls/token"),
        volumes={_volume(tmp_path / "data"): "/data", secrets: "/tls:ro"},
    )
    assert containers.exit_code("scheduler") == 2
    said = [line for line in containers.logs("scheduler").splitlines() if line.strip()]
    assert said == ["swarm: error: --token-file /tls/token: cannot read it (Permission denied)"]


# pip's own settings the build may take as build arguments: none names an index or a secret
PIP_ARGUMENTS = {
    "PIP_NO_CACHE_DIR",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_CONFIG_FILE",
}


def test_the_containerfile_takes_pips_settings_as_a_secret_not_as_build_arguments() -> None:
    """The image every role runs is built on the stage that installs the dependencies: a build
    argument of any stage it is built on is in its history, and an ENV in its environment, for
    anyone who pulls it (an index's credentials). pip's settings come as a secret instead."""
    text = (ROOT / "Containerfile").read_text()
    arguments = set(re.findall(r"^ARG\s+(PIP_\w+)", text, re.MULTILINE))
    assert arguments <= PIP_ARGUMENTS, sorted(arguments - PIP_ARGUMENTS)
    assert not re.findall(r"^ENV\b.*\bPIP_", text, re.MULTILINE)
    steps = [line for line in text.replace("\\\n", " ").splitlines() if line.startswith("RUN ")]
    fetches = re.compile(r"pip (install|wheel) (?!--no-deps --no-index)")  # all but the wheel's
    installs = [step for step in steps if fetches.search(step)]
    assert len(installs) == 4, installs  # torch, the dependencies, the wheel, the test stage's
    assert all("--mount=type=secret,id=pip.conf" in step for step in installs), installs


def test_the_images_history_and_environment_name_none_of_pips_settings(built: str) -> None:
    """Read with this host's own settings, which the build was given (as a secret)."""
    history = image.podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", built).stdout
    assert "--mount=type=secret,id=pip.conf" in history  # the steps that had them
    env = image.podman("image", "inspect", "--format", "{{json .Config.Env}}", built).stdout
    assert "PIP_" not in env, env
    settings = image.pip_settings()
    if not settings:
        pytest.skip("this host gives pip no settings: the build had none to name")
    values = {value for setting in settings.values() for value in setting.split()}
    named = sorted(v for v in values if f"={v}" in history or v in env)
    assert named == [], history


def test_the_image_holds_this_trees_code(built: str) -> None:
    """Every module of the tree's packages is in the image, and each reads as in the tree: a
    build after a change installs the change. (The install's RUN mounts the wheel, and a RUN's
    cache is keyed by its text and parent layer, not by what it mounts: an image built after
    `swarm/deadline.py` was added kept a cached older swarm without it, until the wheel's
    checksum became a layer of its own.)"""
    packages = ("swarm", "stage_server", "scheduler", "client")
    ours = {
        str(path.relative_to(ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()
        for top in packages
        for path in sorted((ROOT / top).rglob("*.py"))
    }
    listing = (
        "import hashlib, pathlib, sys\n"
        "site = pathlib.Path(__import__('swarm').__file__).parent.parent\n"
        f"for top in {packages!r}:\n"
        "    for p in sorted((site / top).rglob('*.py')):\n"
        "        print(p.relative_to(site), hashlib.sha256(p.read_bytes()).hexdigest())\n"
    )
    done = image.podman("run", "--rm", "--entrypoint", "python", built, "-c", listing)
    theirs = dict(line.split(" ") for line in done.stdout.splitlines() if line.strip())
    assert sorted(ours.keys() - theirs.keys()) == [], "missing from the image"
    stale = sorted(name for name in ours if theirs.get(name) != ours[name])
    assert stale == [], "differ in the image"


def test_the_fast_tests_pass_inside_the_image(built: str) -> None:
    """`make image-test`: the Containerfile's `test` stage (the image every role runs, with
    pytest and the tests on top) runs its container-safe share of the fast tests as the image's
    user; the image itself has neither (checked too)."""
    tag = built + "-inside"
    image.build(tag, target="test")
    done = subprocess.run(
        ["podman", "run", "--rm", "--network", "host", "--ulimit", "host", tag],
        capture_output=True,
        text=True,
        env=image.podman_env(),
        timeout=1200,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert re.search(r"^\d+ passed", done.stdout.strip().splitlines()[-1]), said[-3000:]
    bare = image.podman(
        "run",
        "--rm",
        "--entrypoint",
        "sh",
        built,
        "-c",
        "ls /opt; python -c 'import pytest'",
        check=False,
    )
    assert "swarm-tests" not in bare.stdout and bare.returncode != 0, bare
