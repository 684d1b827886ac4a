"""bench/audit_tail_model.py, the model of where the push plane's audits cost a step (issue 69):
with nothing audited the step ends as its pushes do, each microbatch runs each stage once, and
audits only ever add to a step."""

from __future__ import annotations

import random

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
