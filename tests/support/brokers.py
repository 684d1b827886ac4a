"""Brokers for tests: a real Mosquitto in a child process (generated, or `running` a written
config), either broker behind one interface (`broker`, the embedded one and Mosquitto in turn),
and small waiting helpers.

Every wait here is bounded; a broker that does not come up fails the test with its own log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from swarm.bus.broker import EmbeddedBroker
from swarm.net.tls import Tls
from tests.support.ports import free_port

__all__ = [
    "BUNDLED_ACL",
    "MOSQUITTO",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "BrokerUnderTest",
    "Mosquitto",
    "broker",
    "mosquitto",
    "reachable_dir",
    "running",
    "wait_for_port",
]

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
BUNDLED_ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto" / "acl"
"""The ACL the project ships for Mosquitto; tests run it as is."""
START_TIMEOUT_S = 10.0
"""How long a broker may take to accept connections."""
STOP_TIMEOUT_S = 5.0
"""How long a broker may take to exit after SIGTERM before it is killed."""


def wait_for_port(
    host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once `host:port` accepts TCP connections; raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"broker exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepts connections on {host}:{port}") from None
            time.sleep(0.02)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within `STOP_TIMEOUT_S`."""
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)


class Mosquitto:
    """A Mosquitto broker on 127.0.0.1:`port` with a generated config under `workdir`.

    Anonymous access, no persistence; `stop()` then `start()` restarts it on the same port.
    With `users` (username -> password) only they may connect; with `acl` the bundled ACL
    (`examples/mosquitto/acl`: each peer publishes only its own topics) applies.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        workdir: Path,
        port: int = 0,
        *,
        acl: bool = False,
        users: dict[str, str] | None = None,
        tls: Tls | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port(self.host)
        self.acl, self.users, self.tls = acl, dict(users or {}), tls
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("mosquitto already running")
        self._starts += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "mosquitto.conf"
        log_path = self.workdir / f"mosquitto-{self._starts}.log"
        access = "allow_anonymous true\n"
        if self.users:
            passwords = self.workdir / "passwd"
            passwords.write_text("")
            for user, password in self.users.items():
                subprocess.run(
                    [MOSQUITTO_PASSWD, "-b", str(passwords), user, password],
                    check=True,
                    capture_output=True,
                )
            access = f"allow_anonymous false\npassword_file {passwords}\n"
        if self.acl:
            access += f"acl_file {BUNDLED_ACL}\n"
        if self.tls:  # as docs/deployment.md configures it: the swarm CA, mutual if asked
            t = self.tls
            access += f"cafile {t.ca_path}\ncertfile {t.cert_path}\nkeyfile {t.key_path}\n"
            access += f"require_certificate {'true' if t.mutual else 'false'}\n"
        config.write_text(
            f"listener {self.port} {self.host}\n" + access + "persistence false\n"
            "log_dest stderr\n"
            # Started as root, mosquitto would switch to user "mosquitto"; stay who we are.
            f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
        )
        with log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [MOSQUITTO, "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_for_port(self.host, self.port, START_TIMEOUT_S, self._proc)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"mosquitto did not start: {exc}\n{log_path.read_text()}") from exc

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)

    def __enter__(self) -> Mosquitto:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextlib.contextmanager
def mosquitto(workdir: Path, port: int = 0) -> Iterator[Mosquitto]:
    """Run Mosquitto on a free port (or `port`) for the duration of the block."""
    if not Path(MOSQUITTO).exists():
        raise RuntimeError(f"mosquitto not found at {MOSQUITTO}; install the Debian package")
    with Mosquitto(workdir, port) as broker:
        yield broker


@contextlib.contextmanager
def reachable_dir() -> Iterator[Path]:
    """A directory that user mosquitto can enter (pytest's own are root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="swarm-broker-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path)


@contextlib.contextmanager
def running(conf: Path, port: int) -> Iterator[Path]:
    """`mosquitto -c conf` (as we are), listening on `port`; yields its log. Waited for by its
    log's word that it runs (after its listeners opened), not by dialling `port`: a TLS
    listener logged a dial closed before its handshake, now and then, as an OpenSSL error,
    which a test reading the log for errors then failed on."""
    log = conf.with_name("mosquitto.log")
    with log.open("wb") as out:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _says_running(log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                gone = f"exited with {proc.returncode}" if proc.returncode is not None else ""
                said = gone or f"not running on port {port} after {START_TIMEOUT_S} s"
                raise AssertionError(f"mosquitto did not start: {said}\n{log.read_text()}")
            time.sleep(0.02)
        yield log
    finally:
        _stop(proc)


def _says_running(log: str) -> bool:
    """Mosquitto's line once every listener is open: "mosquitto version X running"."""
    return any(line.endswith(" running") for line in log.splitlines())


class BrokerUnderTest:
    """Either broker behind one interface, so each test runs against both."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self._mosquitto = Mosquitto(workdir) if kind == "mosquitto" else None
        self._embedded: EmbeddedBroker | None = None
        self.port = self._mosquitto.port if self._mosquitto else 0

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    async def start(self) -> None:
        if self._mosquitto is not None:
            await asyncio.to_thread(self._mosquitto.start)
        else:
            self._embedded = EmbeddedBroker(port=self.port)
            await self._embedded.start()
            self.port = self._embedded.port

    async def stop(self) -> None:
        if self._mosquitto is not None:
            await asyncio.to_thread(self._mosquitto.stop)
        elif self._embedded is not None:
            await self._embedded.stop()
            self._embedded = None


@pytest.fixture(params=["amqtt", "mosquitto"])
async def broker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BrokerUnderTest]:
    under_test = BrokerUnderTest(request.param, tmp_path / "broker")
    await under_test.start()
    try:
        yield under_test
    finally:
        await under_test.stop()
