"""bench/audit_tail_model.py, the model of where the push plane's audits cost a step (issue 69):
with nothing audited the step ends as its pushes do, each microbatch runs each stage once, and
audits only ever add to a step."""

from __future__ import annotations

import random

import pytest

from bench import audit_tail_model as model


def test_without_audits_a_step_ends_as_its_pushes_do() -> None:
    costs = model.Costs(forward=0.06, backward=0.12, fraction=0.045)
    for policy in model.POLICIES:
        done = model.step(costs, policy, False, random.Random(0))
        assert done.audited == done.pushed > 0


def test_audits_only_ever_add_to_a_step() -> None:
    costs = model.Costs(forward=0.06, backward=0.12, fraction=1.0)  # every stage redone
    for seed in range(5):
        off = model.step(costs, "fifo", False, random.Random(seed))
        on = model.step(costs, "ahead", True, random.Random(seed))
        assert on.audited > on.pushed and off.audited == off.pushed


def test_the_model_prints_each_queue_policy() -> None:
    assert model.main(["--steps", "5"]) == 0


def test_steps_one_after_another_without_audits_cost_their_pushes_and_commits() -> None:
    costs = model.Costs(forward=0.06, backward=0.12, fraction=0.045)
    for deferred in (False, True):
        run = model.simulate(
            costs, "ahead", False, random.Random(0), steps=4, commit=0.15, deferred=deferred
        )
        one = model.step(costs, "ahead", False, random.Random(0)).pushed
        assert run.ends[-1] == pytest.approx(4 * (one + 0.15))  # idle replicas at each start
        assert run.late == run.cut == 0


def _every_stage_redone(
    policy: str, seed: int, steps: int, deferred: bool, contributions_wait: bool
) -> model._Sim:
    """`steps` steps of 150 ms commits, every stage audited and every contribution drawn."""
    return model.simulate(
        model.Costs(forward=0.06, backward=0.12, fraction=1.0),
        policy,
        True,
        random.Random(seed),
        steps=steps,
        commit=0.15,
        deferred=deferred,
        contributions_wait=contributions_wait,
    )


def test_a_commit_that_no_longer_waits_for_its_audits_ends_no_later() -> None:
    """Every stage redone (fraction 1, every contribution drawn): with the contributions' audits
    waiting (their digests judged at the round) a deferred step is the old one; with every
    audit off the critical path the step's commit starts as its pushes end, and the audits left
    over run into the next step (cut where not ended by its commit's end, counted)."""
    runs = {
        (deferred, wait): _every_stage_redone("ahead", 3, 6, deferred, wait)
        for deferred, wait in ((False, True), (True, True), (True, False))
    }
    assert runs[(True, True)].ends == runs[(False, True)].ends  # every path holds one drawn
    assert runs[(True, True)].late == 0
    late = runs[(True, False)]
    assert late.late == 6 * model.MICROBATCHES and 0 <= late.cut <= late.late
    assert late.ends[0] < runs[(False, True)].ends[0]  # the first commit no longer waits


def test_the_built_queue_runs_gating_reexecutions_ahead_and_late_ones_in_turn() -> None:
    """`split`, as built (`stage_server.replica.answering`): where every audit gates its
    microbatch's report it is `ahead`, call for call; where every audit is late it is `fifo`."""

    def run(policy: str, deferred: bool) -> model._Sim:
        return _every_stage_redone(policy, 5, 4, deferred, False)

    assert run("split", False).ends == run("ahead", False).ends != run("fifo", False).ends
    assert run("split", True).ends == run("fifo", True).ends != run("ahead", True).ends
