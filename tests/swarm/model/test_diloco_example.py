"""examples/diloco.toml: the local-steps example loads as a valid local-steps job, fits `swarm
demo`'s stage servers with a pool of two or more at every stage, and trains."""

from __future__ import annotations

import math
from pathlib import Path

from client.demo import DEFAULT_THROTTLES
from swarm.job.config import load_job
from swarm.job.rule import RuleKind, rule_of
from swarm.model.local_steps import train_replicas
from swarm.ops.progress import StepRecord

DILOCO = Path(__file__).resolve().parents[3] / "examples" / "diloco.toml"


def test_the_diloco_example_is_a_local_steps_job_the_demo_can_run() -> None:
    job = load_job(DILOCO)
    rule = rule_of(job)
    assert (job.name, rule.kind, rule.round_steps) == ("diloco", RuleKind.LOCAL, 16)
    # checkpoint_every unset: the first round end at or after step 100
    assert job.training.checkpoint_every == 112
    assert job.training.steps % rule.round_steps == 0  # whole rounds
    # `swarm demo --job examples/diloco.toml`: every stage gets a pool to average
    assert len(DEFAULT_THROTTLES) >= 2 * job.training.stages


def test_the_diloco_example_trains_in_process() -> None:
    # Two replicas of each stage, 4 steps (the file's 160 are too many for a test) and the
    # round that always ends after the last: the loss falls, each step counts its samples once.
    job = load_job(DILOCO)
    records: list[StepRecord] = []
    train_replicas(job, replicas=2, steps=4, on_step=records.append)
    losses = [r.loss for r in records if r.samples]
    assert [r.samples for r in records if r.samples] == [32] * 4
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
