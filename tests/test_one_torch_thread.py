"""Every test starts on one torch thread, whatever a test before it in its process did
(`tests.support.threads`): a test that ran `swarm local`'s main in its xdist worker (every core,
its default) left that worker on two threads for the rest of the run, where the suite's torch
work contends with the swarm processes it starts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

INNER = """
import torch

from tests.support.threads import one_torch_thread  # noqa: F401


def test_one_that_runs_swarm_local_here():
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)  # what `swarm local`'s main does on this 2-core machine


def test_the_next_one():
    assert torch.get_num_threads() == 1
"""


def test_a_test_after_one_that_ran_swarm_local_in_its_process_starts_on_one_thread(
    tmp_path: Path,
) -> None:
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(INNER))
    plain = ("-p", "no:xdist", "-p", "no:asyncio", "-p", "no:cacheprovider")
    args = [str(inner), "-q", *plain, "--rootdir", str(tmp_path)]
    assert pytest.main(args) == pytest.ExitCode.OK
