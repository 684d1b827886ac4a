"""A stage's state read back from a checkpoint (a rollback's, an export's) is the file's pages,
mapped, not a copy in the reading process's own memory: the scheduler reads each stage of a job
whose model it never holds, one stage at a time, as the rollback sends it to the replicas. Its
anonymous memory (what the kernel cannot drop and read back from the file) grows by a few
pages, not by the stage, in the safetensors format and in the older `.pt` one."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from swarm.model import checkpoint

STAGE_BYTES = 96 << 20
SLACK = 16 << 20  # the interpreter's own churn: far below the stage


def _anonymous() -> int:
    """This process's resident anonymous memory, bytes."""
    status = Path("/proc/self/status").read_text()
    match = re.search(r"RssAnon:\s+(\d+) kB", status)
    assert match is not None, "no RssAnon"
    return int(match.group(1)) * 1024


def _stage() -> dict[str, torch.Tensor]:
    half = STAGE_BYTES // 8  # two float32 tensors
    return {"param/w": torch.full((half,), 0.5), "optim/0/exp_avg": torch.full((half,), 0.25)}


@pytest.mark.parametrize("format", ["safetensors", "pt"])
def test_a_stage_read_back_is_mapped_not_copied(tmp_path: Path, format: str) -> None:
    checkpoint.save_stage(tmp_path, 3, 0, _stage())
    written = next(tmp_path.rglob("stage-0.safetensors"))
    if format == "pt":  # a checkpoint written before the safetensors format
        torch.save(_stage(), written.with_suffix(".pt"))
        written.unlink()
    gc.collect()
    before = _anonymous()
    state = checkpoint.load_stage(tmp_path, 3, 0)
    total = sum(float(t.sum()) for t in state.values())  # every page read
    grown = _anonymous() - before
    assert total == pytest.approx((0.5 + 0.25) * STAGE_BYTES / 8)
    assert grown < SLACK, f"{grown >> 20} MiB of a {STAGE_BYTES >> 20} MiB stage copied"
