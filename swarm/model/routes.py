"""The route record of a job with `pool.mode = "local"`: which replica computed each counted
gradient, which replicas each round averaged, and where each replica came from. With local
steps the replicas of a stage hold different parameters between rounds, so the parameters a
swarm ends with depend on the routes; `swarm local --replicas R --routes FILE` replays this
record and must end with the same parameters (docs/jobs.md, "Pool modes").

The file is JSON lines, one record per line, in the order things happened:
- `{"step": t, "runs": [[index, [stages], [peer of stage 0, ..., peer of stage S-1], {stage:
  peer}], ...]}`: the runs of step t's microbatches whose gradients were counted. A run went
  forward through its chain's replicas and back through the same ones, except at the stages of
  its last element (`back`, often empty): there the Backward ran on that other replica (the
  one that did the Forward failed), recomputing the stage from the same inputs with its own
  parameters. Its gradient counts at `stages` (a replay of a lost gradient counts at fewer
  stages than the pipeline it runs through);
- `{"sync": t, "stage": k, "group": [peers]}`: after step t's local updates, stage k's round:
  these replicas averaged their pseudo-gradients; any other replica of the stage is gone, its
  round's samples dropped. With `pool.overlap = "eager"` two optional keys: `"averaged":
  [peers]`, the members of the round before whose shares made the average this round's outer
  step took (absent: all of them; a member that failed that averaging is not), and, on the
  job's last round, `"mean": [peers]`, the members whose mean is the trained model (absent:
  the group);
- `{"join": t, "stage": k, "peer": p, "source": q}`: from step t on, p is a replica of stage k,
  a copy of q (`source` null: the job's initial parameters, no optimizer state yet);
- `{"resume": t, "stage": k, "peers": [peers]}`: a coordinator (re)started at step t (a
  scheduler's restart) with these replicas of stage k, each holding what the record gave it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from swarm.errors import ConfigError

__all__ = ["Join", "Record", "Resume", "Run", "StepRuns", "Sync", "read_routes", "write_record"]


@dataclass(frozen=True)
class Run:
    index: int
    stages: tuple[int, ...]  # where its gradient counts
    chain: tuple[str, ...]  # the replica (peer) of every stage it went through, 0..S-1
    back: tuple[tuple[int, str], ...] = ()  # (stage, peer) whose Backward ran elsewhere

    def backward_peer(self, stage: int) -> str:
        """The replica whose parameters took the gradient at `stage`."""
        return dict(self.back).get(stage, self.chain[stage])


@dataclass(frozen=True)
class StepRuns:
    step: int
    runs: tuple[Run, ...]


@dataclass(frozen=True)
class Sync:
    step: int
    stage: int
    group: tuple[str, ...]
    averaged: tuple[str, ...] | None = None  # pool.overlap = "eager": see the module's note
    mean: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Join:
    step: int
    stage: int
    peer: str
    source: str | None


@dataclass(frozen=True)
class Resume:
    step: int
    stage: int
    peers: tuple[str, ...]


Record = StepRuns | Sync | Join | Resume


def to_json(record: Record) -> dict[str, object]:
    if isinstance(record, StepRuns):
        runs = [[r.index, list(r.stages), list(r.chain), dict(r.back)] for r in record.runs]
        return {"step": record.step, "runs": runs}
    if isinstance(record, Sync):
        d: dict[str, object] = {"sync": record.step, "stage": record.stage}
        d["group"] = list(record.group)
        for key, value in (("averaged", record.averaged), ("mean", record.mean)):
            if value is not None:
                d[key] = list(value)
        return d
    if isinstance(record, Resume):
        return {"resume": record.step, "stage": record.stage, "peers": list(record.peers)}
    join, source = record.step, record.source
    return {"join": join, "stage": record.stage, "peer": record.peer, "source": source}


def from_json(d: dict[str, object]) -> Record:
    if "runs" in d:
        runs = tuple(
            Run(
                int(i),
                tuple(int(k) for k in stages),
                tuple(str(p) for p in chain),
                tuple(sorted((int(k), str(p)) for k, p in (rest[0] if rest else {}).items())),
            )
            for i, stages, chain, *rest in d["runs"]  # type: ignore[attr-defined]
        )
        return StepRuns(int(d["step"]), runs)  # type: ignore[call-overload]
    if "sync" in d:
        group = tuple(str(p) for p in d["group"])  # type: ignore[attr-defined]
        averaged, mean = (
            None if d.get(k) is None else tuple(str(p) for p in d[k])  # type: ignore[attr-defined]
            for k in ("averaged", "mean")
        )
        return Sync(int(d["sync"]), int(d["stage"]), group, averaged, mean)  # type: ignore[call-overload]
    if "resume" in d:
        peers = tuple(str(p) for p in d["peers"])  # type: ignore[attr-defined]
        return Resume(int(d["resume"]), int(d["stage"]), peers)  # type: ignore[call-overload]
    source = d.get("source")
    return Join(
        int(d["join"]),  # type: ignore[call-overload]
        int(d["stage"]),  # type: ignore[call-overload]
        str(d["peer"]),
        None if source is None else str(source),
    )


def write_record(f: IO[str], records: Iterable[Record]) -> None:
    """Append `records`, a line each, and flush: a record is on disk once its step is done."""
    for record in records:
        f.write(json.dumps(to_json(record), separators=(",", ":")) + "\n")
    f.flush()


def read_routes(path: str | Path) -> Iterator[Record]:
    """The records of a route file, in order; a malformed line is a `ConfigError` naming it."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield from_json(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{n}: not a route record ({e})") from None
