"""Brokers for tests: a real Mosquitto in a child process, and small waiting helpers.

Every wait here is bounded; a broker that does not come up fails the test with its own log.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from swarm.net.tls import Tls
from tests.support.ports import free_port

__all__ = [
    "BUNDLED_ACL",
    "MOSQUITTO",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "Mosquitto",
    "mosquitto",
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
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

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
