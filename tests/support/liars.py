"""A job of three stages of three replicas, one of them a liar (a hostile point of its
`SWARM_FAULTS`), trained with every stage audited on the data plane named: what both planes'
poison tests assert of it (issue 55): caught, banned once with the evidence in the log, rolled
back, the final model equal to `swarm local`'s within 1e-9."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from prometheus_client import CollectorRegistry

from swarm.ops.faults import Fault
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.servers import Servers, counted, train_logged

HOSTILE = "s1r0"  # the middle stage's first replica: its outputs and input gradients both count


class Trained(NamedTuple):
    """A job trained with a liar among its servers: its final state and trainer metrics, the
    liar's own log, and what was logged meanwhile."""

    job: Path  # its job file
    state: dict[str, torch.Tensor]
    registry: CollectorRegistry
    liar_log: str
    said: list[str]


def train_with_a_liar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plane: str, poison: Fault, batch: int = 16
) -> Trained:
    """`HOSTILE` lies as `poison` says, on `plane`, with every stage audited; `batch` samples a
    step (microbatches of 4)."""
    job = write_job(
        tmp_path,
        training={"stages": 3, "steps": 4, "target_batch_size": batch},
        runtime={"data_plane": plane},
        trust={"audit_fraction": 1.0},
    )
    servers = Servers(job, [3, 3, 3], [poison], tmp_path)
    state, registry, said = train_logged(servers, caplog)
    return Trained(job, state, registry, servers.procs[HOSTILE].log(), said)


def assert_caught_and_replayed_away(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    plane: str,
    poison: Fault,
    evidence: str,
    batch: int = 16,
) -> None:
    """`HOSTILE` lies as `poison` says on `plane`; its ban's message names `evidence`."""
    job, state, registry, liar_log, said = train_with_a_liar(tmp_path, caplog, plane, poison, batch)
    assert "answers wrong numbers" in liar_log  # armed to lie (the ban shows it was routed)
    assert_equal_to_local(job, state, tol=1e-9)
    assert counted(registry, "swarm_coordinator_bans_total") == 1, said
    assert counted(registry, "swarm_coordinator_rollbacks_total") >= 1
    banned = [m for m in said if "banned" in m and "caught it lying" in m]
    assert len(banned) == 1 and f"banned {HOSTILE} (stage 1)" in banned[0], banned
    assert evidence in banned[0], banned  # the evidence
    assert any("rolled every stage back to step 0: before a banned peer" in m for m in said)
    assert counted(registry, "swarm_trainer_audits_total") > 0
