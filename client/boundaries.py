"""A job's boundaries as `swarm status` shows them: for each boundary between stages k and k+1,
the bytes per token that crossed it forward (stage k's outputs, sent by its replicas) and
backward (their gradient, sent by stage k+1's), as encoded on the wire, summed over the
replicas' load reports (`Replica.boundary`: what each sent since it began serving its stage).

Why bytes per token: it is the job's own figure (d_model values of the wire codec's size, or
fewer with a smaller boundary) whatever the batch, and what decides how many tokens a second a
link carries: a link of R bytes/s carries R / (bytes per token) tokens a second each way."""

from __future__ import annotations

import itertools

from swarm.ops.boundary_bytes import Way, per_token
from swarm.proto import scheduler_pb2

__all__ = ["boundary_rows"]


def _text(stage: scheduler_pb2.StageStatus, way: Way) -> str:
    value = per_token((r.boundary for r in stage.replicas), way)
    return "-" if value is None else f"{value:.1f}"


def boundary_rows(s: scheduler_pb2.JobStatus) -> list[list[str]]:
    """The job's boundaries as a table's rows (its header first), bytes per token each way;
    none before any replica reported a boundary's traffic (or for a job of one stage)."""
    rows = [
        [f"  {a.stage}|{b.stage}", _text(a, "forward"), _text(b, "backward")]
        for a, b in itertools.pairwise(s.stages)
    ]
    if all(r[1:] == ["-", "-"] for r in rows):
        return []
    return [["  BOUNDARY", "FORWARD B/TOKEN", "BACKWARD B/TOKEN"], *rows]
