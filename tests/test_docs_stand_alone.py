"""The docs stand alone: a clone of this repository is all a reader has, so no document names a
file outside it (a relative link that climbs out of the repository, or a planning file that lives
beside it such as `DESIGN.md`). What the project follows of its design is summed up in
docs/architecture.md ("The design, in brief")."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import ROOT

OUTSIDE_FILES = ("DESIGN.md", "STYLE.md", "ANCHORS.md", "DEVELOPERS.md")
"""Files that sit beside a checkout (for its engineers), never in it."""
PATH = re.compile(r"(?<![\w/.])(?:\.\./|/work/)[\w./-]*")
"""A path that leaves the repository: one that climbs out of it, or the workplace the repository
was written in. (A user's own paths, such as `~/.cache/swarm/`, are places the code writes to.)"""
SKIP_DIRS = frozenset({".git", ".venv", "node_modules", ".pytest_cache", ".mypy_cache"})


def documents(root: Path = ROOT) -> Iterator[Path]:
    for path in sorted(root.rglob("*.md")):
        if not SKIP_DIRS.intersection(path.relative_to(root).parts):
            yield path


def outside_mentions(text: str, where: str) -> list[str]:
    """`where:line: ...` for every mention in `text` of a file outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name in OUTSIDE_FILES:
            if name in line:
                found.append(f"{where}:{number}: names {name}, which a clone does not have")
        for match in PATH.finditer(line):
            found.append(f"{where}:{number}: names {match.group()}, outside the repository")
    return found


def test_no_document_names_a_file_outside_the_repository() -> None:
    bad = [
        mention
        for path in documents()
        for mention in outside_mentions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    if bad:
        pytest.fail("documents that do not stand alone:\n" + "\n".join(bad))


def test_architecture_sums_up_the_design() -> None:
    text = (ROOT / "docs/architecture.md").read_text()
    assert "## The design, in brief" in text
    decisions = (ROOT / "docs/decisions.md").read_text()
    assert '"The design, in brief"' in decisions, "decisions.md says where the design it cites is"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("see `../shared/DESIGN.md`", 2),  # both a climbing path and the file's name
        ("[guide](../other/guide.md)", 1),
        ("DESIGN.md says so", 1),
        ("`docs/deployment.md` and `./bench/nat.py`", 0),
        ("`/work/shared/notes.txt`", 1),
        ("the cache under `~/.cache/swarm/`", 0),
        ("a ratio of 0.5..0.8 and `swarm/net/`", 0),
    ],
)
def test_outside_mentions_bite(line: str, expected: int) -> None:
    assert len(outside_mentions(line, "x.md")) == expected
