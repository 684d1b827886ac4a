"""docs/deployment.md's code blocks, for the tests that follow the guide word for word: a
section's blocks, each with only hosts, ports and paths replaced (every replacement asserted to
be there, so the test fails when the guide changes under it), run by bash in a directory laid out
as the guide says, with `swarm` where the guide's `source .venv/bin/activate` finds it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from tests.support.cli import ROOT
from tests.support.namespaces import PROXIES

__all__ = [
    "DOC",
    "bash",
    "bash_env",
    "blocks",
    "checkout",
    "commands",
    "examples",
    "machine",
    "replaced",
]

DOC = ROOT / "docs" / "deployment.md"


def blocks(heading: str) -> list[str]:
    """The fenced blocks under `heading`, up to the next heading of its level or above."""
    text = DOC.read_text()
    assert heading in text, f"{DOC} has no heading {heading!r}"
    level = len(heading.split()[0])
    lines, fenced = [], False
    for line in text.split(heading, 1)[1].splitlines(keepends=True):
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):  # a shell comment is no heading
            break
        lines.append(line)
    return re.findall(r"^```[a-z]*\n(.*?)^```", "".join(lines), re.MULTILINE | re.DOTALL)


def replaced(text: str, substitutions: dict[str, str]) -> str:
    for old, new in substitutions.items():
        assert old in text, f"the doc's block no longer says {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


def commands(block: str) -> list[list[str]]:
    """Each command of `block` (continuations joined, comments dropped) as its words."""
    return [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]


def checkout(directory: Path) -> Path:
    """`directory` made to stand for a checkout set up by `make install`, as the guide assumes:
    its `.venv` is the environment tests run in (its `swarm` imports this tree: `bash_env`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return directory


def machine(directory: Path, issuer: Path, cert: str) -> Path:
    """A machine's checkout in `directory`, given what section 2 says to give it from `issuer`'s:
    `certs/ca.pem`, its own certificate `cert` and key (and no other key), the tokens."""
    home = checkout(directory)
    (home / "certs").mkdir(mode=0o700)
    for name in ("ca.pem", f"{cert}.pem", f"{cert}.key"):
        shutil.copy2(issuer / "certs" / name, home / "certs" / name)
    for name in ("token", "metrics-token"):
        shutil.copy2(issuer / name, home / name)
    return home


def examples(home: Path, edits: dict[str, str]) -> None:
    """The checkout's examples the guide copies into `home`: the data, and its job with `edits`
    (each asserted to be there)."""
    (home / "examples").mkdir()
    shutil.copytree(ROOT / "examples" / "data", home / "examples" / "data")
    job = (ROOT / "examples" / "llama-small.toml").read_text()
    (home / "examples" / "llama-small.toml").write_text(replaced(job, edits))


def bash(script: str) -> list[str]:
    """The argv that runs `script` as a reader's shell would, stopping at the first failure."""
    return ["bash", "-euo", "pipefail", "-c", script]


def bash_env(**extra: str) -> dict[str, str]:
    """This environment without the swarm's variables (the guide sets its own) or proxies,
    importing this tree, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env = {k: v for k, v in env.items() if k.lower() not in PROXIES}  # none in a namespace
    return env | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"} | extra
