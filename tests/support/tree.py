"""The suite writes nothing into the repository: `untouched_tree` fails a test after which one
of the paths a command writes by default, relative to where it runs (the repository root, under
`make test`), appeared there. A scheduler started without `--checkpoint-dir` made its signing key
in `swarm-checkpoints/` of the tree, and one such key was committed: a key anyone who clones the
repository holds, which a scheduler started on the default folder would sign with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cli import ROOT

__all__ = ["DEFAULT_OUTPUTS", "untouched_tree"]

#: What the commands write where they run unless told otherwise: the scheduler's checkpoints
#: (and signing key) and job store, and `swarm certs`' CA.
DEFAULT_OUTPUTS = ("swarm-checkpoints", "swarm-jobs.sqlite", "certs")


@pytest.fixture(autouse=True)
def untouched_tree() -> Iterator[None]:
    before = {name for name in DEFAULT_OUTPUTS if (ROOT / name).exists()}
    yield
    made = [name for name in DEFAULT_OUTPUTS if name not in before and (ROOT / name).exists()]
    if made:
        pytest.fail(
            f"{made} appeared in the repository ({ROOT}) during this test (written by it, or by "
            "one running beside it in another worker): give the command the folder or file to "
            "write (--checkpoint-dir, --store, --dir) under tmp_path",
            pytrace=False,
        )
