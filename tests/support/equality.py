"""Equal to `swarm local`: the parameters a job ends with, compared with the reference training
(`swarm.model.reference.train_local`, what `swarm local` runs; for a rule with rounds,
`swarm.model.local_steps.train_replicas` replaying the run's route record, what `swarm local
--routes` runs) within a per-test tolerance."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from swarm.job.config import JobConfig, load_job
from swarm.job.rule import rule_of
from swarm.model.local_steps import train_replicas
from swarm.model.reference import train_local
from swarm.model.routes import Join, Record, Sync
from swarm.ops.progress import StepRecord

__all__ = [
    "assert_equal_to_local",
    "assert_equal_to_reference",
    "assert_no_member_skipped_a_round",
    "assert_states_within",
    "evaluations",
    "local_evaluations",
    "local_state",
    "reference_state",
]

DEFAULT_TOL = 1e-9
"""float64 training, only the order of float additions differs."""


def local_state(job: JobConfig | Path) -> dict[str, torch.Tensor]:
    """`swarm local`'s final parameters for `job` (a config, or a job file): a copy of the
    reference `_trained` keeps, where the config alone says what it trains on."""
    config = job if isinstance(job, JobConfig) else load_job(job)
    files = (config.data.path, config.data.val_path, config.model.init_from)
    if config.data.kind != "synthetic" or any(f is not None for f in files):
        return train_local(config).state_dict()  # files whose bytes the config does not hold
    return {name: tensor.clone() for name, tensor in _trained(config).items()}


@functools.lru_cache(maxsize=16)
def _trained(config: JobConfig) -> dict[str, torch.Tensor]:
    """The reference training of a job of synthetic data from scratch: a function of its config
    alone (equal configs, from any test's directory, train alike). The suite's parametrized
    fault tests compare a dozen runs of one job with it: trained once, not once per test."""
    return train_local(config).state_dict()


def evaluations(records: Iterable[StepRecord]) -> list[tuple[int, float | None]]:
    """(step, validation loss) of each record that holds one."""
    return [(r.step, r.val_loss) for r in records if r.val_loss is not None]


def local_evaluations(job: JobConfig | Path) -> list[tuple[int, float | None]]:
    """`swarm local`'s evaluations of `job` (`evaluations` of its step records)."""
    config = job if isinstance(job, JobConfig) else load_job(job)
    reference: list[StepRecord] = []
    train_local(config, on_step=reference.append)
    return evaluations(reference)


def assert_states_within(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float
) -> None:
    """Same names, and every tensor within `tol` (max absolute difference) of `expected`'s."""
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        diff = (state[name] - want).abs().max().item()
        assert diff <= tol, f"{name}: {diff}"


def assert_equal_to_local(
    job: JobConfig | Path, state: dict[str, torch.Tensor], tol: float = DEFAULT_TOL
) -> None:
    """`state` equals `swarm local`'s parameters for `job` within `tol`."""
    assert_states_within(state, local_state(job), tol)


def reference_state(job: JobConfig, routes: Iterable[Record]) -> dict[str, torch.Tensor]:
    """`swarm local`'s final parameters for a run of `job` that wrote the route record `routes`:
    replaying it with replicas where the job's rule has rounds, else the one model (a rule
    without rounds writes no record: the reference needs none)."""
    if rule_of(job).records_routes:
        model = train_replicas(job, routes=routes)
        return {k: v.detach() for k, v in model.state_dict().items()}
    return local_state(job)


def assert_equal_to_reference(
    job: JobConfig, state: dict[str, torch.Tensor], routes: Iterable[Record], tol: float
) -> None:
    """`state` equals `reference_state(job, routes)` within `tol`, and (the replay takes the
    record's rounds as they are) no member of a stage skipped a round of it."""
    routes = list(routes)
    assert_no_member_skipped_a_round(routes)
    assert_states_within(state, reference_state(job, routes), tol)


def _at(record: Record, stage: int) -> set[str]:
    """The replicas of `stage` that `record` shows serving it (a copy made, a gradient taken,
    a round averaged)."""
    if isinstance(record, Join):
        return {record.peer} if record.stage == stage else set()
    if isinstance(record, Sync):
        return set(record.group) if record.stage == stage else set()
    return {r.backward_peer(stage) for r in record.runs if stage in r.stages}


def assert_no_member_skipped_a_round(routes: Sequence[Record]) -> None:
    """Judged apart from the replay: each round of a stage (`Sync`) averaged every replica of
    the stage that served it before the round and serves it after without being copied anew
    (`Join`). One left out of a round's group and recorded so, yet training on with its own
    parameters, had its share dropped silently: the replay, following the record, would agree."""
    for i, sync in enumerate(routes):
        if not isinstance(sync, Sync):
            continue
        before = set().union(*(_at(r, sync.stage) for r in routes[:i]))
        for peer in sorted(before - set(sync.group)):
            for later in routes[i + 1 :]:
                if isinstance(later, Join) and (later.stage, later.peer) == (sync.stage, peer):
                    break  # gone from the round, and copied anew: its share went with it
                assert peer not in _at(later, sync.stage), (
                    f"{peer} serves stage {sync.stage} after the round of step {sync.step} "
                    f"without its share in it (group {list(sync.group)}): {later}"
                )
