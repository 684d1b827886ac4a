"""The scheduler with TLS on every interface (`--host 0.0.0.0 --announce-host NAME`, as
docs/deployment.md section 3 starts it) and its embedded broker: it dials its broker on this
machine and checks the broker's certificate for its announced host, the name its peers check.
Before, it checked the certificate for 127.0.0.1, the host it dialled, and stopped at start. A
certificate not issued for the announced host (the guide once gave it gpu1's) stops it at start,
naming the flag and the command that fixes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.bus.connection import Bus, BusRefused, BusSettings
from swarm.errors import ConfigError
from swarm.local.procs import start_process
from swarm.net import tls
from swarm.net.certs import init_ca, issue
from tests.support.cli import swarm

ANNOUNCED = "sched.test"  # a name only: nothing resolves it, nothing dials it


@pytest.fixture(autouse=True)
def unconfigured() -> Iterator[None]:
    """The process's identity is set by a test for itself; none stays for the next one."""
    try:
        yield
    finally:
        tls.configure(None)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """The swarm CA, the scheduler's certificate for ANNOUNCED only, gpu1's for its address."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue(certs, "scheduler", [ANNOUNCED])
    issue(certs, "gpu1", ["203.0.113.7"])
    issue(certs, "wild", ["*.example.org", "10.0.0.1"])
    issue(certs, "six", ["2001:db8::7"])
    return certs


def _identity(certs: Path, name: str) -> tls.Tls:
    return tls.Tls.load(certs / "ca.pem", certs / f"{name}.pem", certs / f"{name}.key", True)


def test_a_certificate_names_the_hosts_it_was_issued_for(certs: Path) -> None:
    _identity(certs, "scheduler").check_names(ANNOUNCED, "the scheduler")
    _identity(certs, "scheduler").check_names(ANNOUNCED.upper(), "the scheduler")
    _identity(certs, "gpu1").check_names("203.0.113.7", "the scheduler")
    _identity(certs, "wild").check_names("sched.example.org", "the scheduler")
    _identity(certs, "wild").check_names("10.0.0.1", "the scheduler")
    # An IPv6 address as a URL writes it, in brackets, is the same address.
    _identity(certs, "six").check_names("[2001:db8::7]", "the scheduler")
    _identity(certs, "six").check_names("2001:db8::7", "the scheduler")
    for name, host in [("wild", "a.b.example.org"), ("wild", "example.org"), ("gpu1", "gpu1")]:
        with pytest.raises(ConfigError, match=f"not {host}, the host the scheduler announces"):
            _identity(certs, name).check_names(host, "the scheduler")


async def _connect(url: str, server_name: str | None, timeout: float) -> None:
    """Connected to the broker at `url` within `timeout`, else what the bus raised."""
    bus = Bus(
        url,
        "own",
        registry=CollectorRegistry(),
        settings=BusSettings(operation_timeout_s=3.0),
        server_name=server_name,
    )
    async with bus:
        await bus.wait_connected(timeout)


@pytest.mark.filterwarnings("ignore:unclosed <ssl.SSLSocket:ResourceWarning")
async def test_its_own_broker_is_checked_for_the_announced_name(certs: Path) -> None:
    tls.configure(_identity(certs, "scheduler"))
    async with EmbeddedBroker("0.0.0.0", 0, announce_host=ANNOUNCED) as broker:
        assert broker.url.startswith(f"mqtts://{ANNOUNCED}:")
        assert broker.local_url.startswith("mqtts://127.0.0.1:")
        await _connect(broker.local_url, ANNOUNCED, 6.0)
        # Checked for the host dialled (as before), or another name: refused.
        for name in (None, "other.test"):
            with pytest.raises(BusRefused, match=r"TLS refused: .* does not name the host dialled"):
                await _connect(broker.local_url, name, 3.0)


def _tls_env(certs: Path, name: str) -> dict[str, str]:
    return {
        "SWARM_TOKEN": "own-broker-token",
        "SWARM_TLS_CA": str(certs / "ca.pem"),
        "SWARM_TLS_CERT": str(certs / f"{name}.pem"),
        "SWARM_TLS_KEY": str(certs / f"{name}.key"),
        "SWARM_TLS_MUTUAL": "1",
    }


def _args(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return [
        "scheduler",
        *("--host", "0.0.0.0", "--announce-host", ANNOUNCED, "--port", "0"),
        *("--store", str(tmp_path / "jobs.sqlite"), "--checkpoint-dir", str(tmp_path / "ckpt")),
        *("--data-root", str(data)),
        "--insecure-no-token",  # every interface, no token: meant here (TLS is the subject)
    ]


@pytest.mark.slow
def test_a_scheduler_on_every_interface_with_tls_starts(tmp_path: Path, certs: Path) -> None:
    proc = start_process(_args(tmp_path), log_dir=tmp_path, env=_tls_env(certs, "scheduler"))
    try:
        ready = proc.wait_ready(60)
    finally:
        proc.stop()
    assert ready["broker"].startswith(f"mqtts://{ANNOUNCED}:"), ready
    assert "Traceback" not in proc.log(), proc.log()


@pytest.mark.slow
def test_a_scheduler_with_another_hosts_certificate_stops_naming_the_fix(
    tmp_path: Path, certs: Path
) -> None:
    done = swarm(*_args(tmp_path), env=_tls_env(certs, "gpu1"), check=False, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    gpu1 = certs / "gpu1.pem"
    assert (
        f"--tls-cert {gpu1} names 203.0.113.7, not {ANNOUNCED}, the host the scheduler "
        "announces (--announce-host): every peer dialling it there would refuse it. Give the "
        f"scheduler a certificate of its own for that host: `swarm certs issue NAME --host "
        f"{ANNOUNCED}`"
    ) in done.stderr, done.stderr
