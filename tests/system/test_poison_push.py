"""Issue 55 on the push plane (the default): a stage server (its own process) that sends finite
wrong activations or wrong input gradients straight to the next stage, every step or one step in
20, or that commits to the honest outputs' digest while it sends others, in a float64 job of
three stages of three replicas. Each replica commits to the digests of what it received and sent
(`stage_server.replica.push_records`); the trainer takes every commitment of the path before it
draws what to audit (every stage here, so the catch is certain), checks that the two sides of
every boundary agree, and has another replica re-execute a drawn stage from the tensors its
record holds (`client.audit.push_audit`). The liar is banned with the evidence in the log,
the job rolls back to before its first step and replays without it: the final model equals
`swarm local`'s within 1e-9."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.ops.faults import Fault, Point
from tests.support.equality import assert_equal_to_local
from tests.support.jobs import write_job
from tests.support.liars import HOSTILE, assert_caught_and_replayed_away, train_with_a_liar
from tests.support.servers import Servers, counted, train_logged

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("poison", "evidence"),
    [
        pytest.param(
            Fault(HOSTILE, Point.POISON_OUTPUTS, 0),
            "re-executed",
            marks=pytest.mark.attack("P-push-acts"),
        ),
        pytest.param(
            Fault(HOSTILE, Point.POISON_GRAD_INPUTS, 0),
            "re-executed",
            marks=pytest.mark.attack("P-push-grads"),
        ),
        # one step in 20: the job's first step is the only one it lies at. That step has 12
        # microbatches (a batch of 48, below): some stage-0 replica pushes 4 or more of them and
        # tries every stage-1 replica before any twice (`swarm.policy.stage_pool`), so the liar
        # is routed in the one step it lies at; a later step's routing would leave it to chance
        pytest.param(
            Fault(HOSTILE, Point.POISON_OUTPUTS, 0, 20),
            "re-executed",
            marks=pytest.mark.attack("P-push-acts"),
        ),
        pytest.param(
            Fault(HOSTILE, Point.POISON_GRAD_INPUTS, 0, 20),
            "re-executed",
            marks=pytest.mark.attack("P-push-grads"),
        ),
        # commits to the honest outputs' digest, sends others: the stage after says so
        pytest.param(
            Fault(HOSTILE, Point.POISON_SENT_OUTPUTS, 0),
            "received",
            marks=pytest.mark.attack("P-push-sent"),
        ),
    ],
    ids=str,
)
def test_a_push_replica_that_lies_is_caught_banned_and_replayed_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, poison: Fault, evidence: str
) -> None:
    batch = 48 if poison.period > 1 else 16
    assert_caught_and_replayed_away(tmp_path, caplog, "push", poison, evidence, batch=batch)


# a subspace boundary too: its token ids travel beside the activations, committed to as well
@pytest.mark.parametrize("model", [{}, {"boundary_rank": 4}], ids=["full", "subspace"])
def test_an_honest_push_run_with_every_stage_audited_accuses_nobody(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, model: dict[str, int]
) -> None:
    job = write_job(
        tmp_path,
        model=model,
        training={"stages": 3, "steps": 3, "target_batch_size": 16},
        runtime={"data_plane": "push"},
        trust={"audit_fraction": 1.0},
    )
    servers = Servers(job, [2, 2, 2], [], tmp_path)
    state, registry, said = train_logged(servers, caplog)
    assert_equal_to_local(job, state, tol=1e-9)
    assert counted(registry, "swarm_coordinator_bans_total") == 0
    assert not [m for m in said if "disagree" in m or "caught" in m], said
    audits = {
        s.labels["outcome"]: s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == "swarm_trainer_audits_total"
    }
    assert audits.get("agreed", 0) > 0 and "caught" not in audits, audits


@pytest.mark.attack("P-push-bent")
def test_a_push_replica_that_bends_its_contribution_is_caught_banned_and_replayed_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pushes are honest (what it sends and commits to, forward and back); what it adds to
    its pool's averaging is its gradient sums bent within the norm bound, which no boundary
    check sees. Its microbatches, re-executed by the two others of its stage from the tensors
    its neighbours committed to, must tell (`client.audit.push_contributions`)."""
    poison = Fault(HOSTILE, Point.POISON_BENT, 0)
    # From step 0 on, with 12 microbatches a step (a batch of 48), for the reason the
    # one-step-in-20 cases above give: step 0 routes the liar work by construction. Lying from
    # step 1 on with 4 microbatches a step, a liar measured slow at step 0 on a loaded machine
    # was routed nothing at any step it lied at, its bent sums empty: nothing to catch, and the
    # ban count read 0 (1 run in 18 under load). 12 alone left it to the queues' growth; the
    # relay plane's case failed the same way (docs/decisions.md, "A lie needs work to lie
    # about").
    job, state, registry, liar_log, said = train_with_a_liar(
        tmp_path, caplog, "push", poison, batch=48
    )
    assert "fault injected: poison-bent@0" in liar_log  # it did lie
    assert_equal_to_local(job, state, tol=1e-9)
    assert counted(registry, "swarm_coordinator_bans_total") == 1, said
    banned = [m for m in said if f"banned {HOSTILE} (stage 1)" in m]
    assert any("its contribution to step" in m for m in banned), said
    assert not [m for m in said if "not digested" in m], said  # every one it drew was judged
