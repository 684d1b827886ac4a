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
