"""compose.yaml's local swarm is one the CLI takes: every service runs the image's `swarm` with a
command the real parser accepts, every health check asks a port its role listens on, each
process announces the service name the others dial it by, and the token comes from a secret
file, never from a command line (issue 56). The image itself is built and run by
tests/system/test_container.py."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
import yaml

from swarm.cli import parse
from tests.support.cli import ROOT


def _services() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services: dict[str, dict[str, Any]] = doc["services"]
    return services


def test_the_swarm_has_a_scheduler_four_stage_servers_a_relay_and_a_client() -> None:
    roles = sorted(shlex.split(s["command"])[0] for s in _services().values())
    assert roles == ["jobs", "relay", "scheduler", *["stage-server"] * 4]


@pytest.mark.parametrize("name", sorted(_services()))
def test_each_service_command_parses(name: str) -> None:
    service = _services()[name]
    argv = shlex.split(service["command"])
    try:
        args = parse(argv)
    except SystemExit as e:
        pytest.fail(f"compose.yaml's {name}: `swarm {service['command']}` refused (exit {e.code})")
    assert "--token" not in argv, "a token on a command line shows in `ps`"
    assert service["environment"]["SWARM_TOKEN_FILE"] == "/run/secrets/swarm_token"
    assert service["secrets"] == ["swarm_token"]
    if getattr(args, "host", None) == "0.0.0.0":
        assert args.announce_host == name, "it announces the name the others resolve"
    check = service.get("healthcheck", {})
    if not check.get("disable"):
        address = check["test"][check["test"].index("--health-address") + 1]
        assert address == f"127.0.0.1:{args.port}", (name, address)


def _published(spec: str | dict[str, Any]) -> tuple[str | None, str]:
    """A published port's host address (None: every interface) and its text. Compose takes a
    short form, `[HOST_IP:]HOST:CONTAINER[/PROTO]`, or a long one, a mapping with `host_ip`."""
    if isinstance(spec, dict):
        return spec.get("host_ip"), str(spec)
    text = str(spec).split("/")[0]
    if text.startswith("["):  # an IPv6 address: [::1]:7700:7700
        host, _, _ = text[1:].partition("]")
        return host, str(spec)
    parts = text.split(":")
    return (parts[0] if len(parts) == 3 else None), str(spec)


@pytest.mark.attack("64-compose")
@pytest.mark.parametrize("name", sorted(_services()))
def test_every_published_port_is_bound_to_loopback(name: str) -> None:
    # Docker's published ports are written into iptables ahead of ufw's rules: a port published
    # on every interface is open to the internet whatever the host's firewall says, and
    # compose's local swarm speaks in clear text (issue 64, item 9).
    for spec in _services()[name].get("ports", []):
        host, text = _published(spec)
        assert host == "127.0.0.1", f"compose.yaml's {name} publishes {text} beyond loopback"


def test_a_published_port_is_read_with_its_host_address() -> None:
    assert _published("7700:7700") == (None, "7700:7700")
    assert _published("0.0.0.0:7700:7700") == ("0.0.0.0", "0.0.0.0:7700:7700")
    assert _published("127.0.0.1:1883:1883/tcp") == ("127.0.0.1", "127.0.0.1:1883:1883/tcp")
    assert _published("[::1]:9100:9100")[0] == "::1"
    assert _published({"target": 7700, "published": 7700})[0] is None
    assert _published({"target": 7700, "host_ip": "127.0.0.1"})[0] == "127.0.0.1"
