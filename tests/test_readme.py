"""README's commands are the ones the CLI takes: every `.venv/bin/swarm ...` line of its code
blocks that is a plain command (not `a | b` or `[--x]` shorthand) parses with the real parser, so
a flag renamed or removed cannot leave the recipe a new user follows wrong."""

from __future__ import annotations

import re
import shlex

import pytest

from swarm.cli import parse
from tests.support.cli import ROOT


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("#", 1)[0].strip().removesuffix("&").strip()
            if not command.startswith(".venv/bin/swarm "):
                continue
            if re.search(r"\[|\||\.\.\.", command):
                continue  # shorthand for several commands
            found.append(command)
    return found


def test_readme_has_commands_to_check() -> None:
    assert len(_commands()) >= 8  # the service, the client, the standalone trainer


@pytest.mark.parametrize("command", _commands())
def test_each_readme_command_parses(command: str) -> None:
    argv = shlex.split(command)[1:]
    try:
        parse(argv)
    except SystemExit as e:  # argparse's refusal, with its message on stderr
        pytest.fail(f"README's `{command}` is refused by the CLI (exit {e.code})")
