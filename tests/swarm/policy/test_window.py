"""The trainer's window (`swarm.policy.window`): `max_in_flight = N` is N; "auto" is what the
narrowest stage that keeps activations holds over its replicas, within the floor, the cap and
the microbatches live at once; a swarm that says nothing keeps the window of old."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm.job.config import JobConfig, load_job
from swarm.policy.window import (
    AUTO_CAP,
    DEFAULT_WINDOW,
    MAX_ANNOUNCED_CAPACITY,
    live_microbatches,
    plausible_capacity,
    window,
)
from tests.support.jobs import write_job


def _job(tmp_path: Path, stages: int = 3, batch: int = 256, **sections: Any) -> JobConfig:
    training = {"stages": stages, "target_batch_size": batch, **sections.pop("training", {})}
    return load_job(write_job(tmp_path, training=training, **sections))  # microbatches of 4


def test_a_fixed_window_is_kept_whatever_the_stages_hold(tmp_path: Path) -> None:
    job = _job(tmp_path, runtime={"max_in_flight": 3})
    assert window(job, []) == 3
    assert window(job, [[40, 40], [40], [40]]) == 3
    assert window(_job(tmp_path, batch=8, runtime={"max_in_flight": 8}), [[1], [1], [1]]) == 8


def test_stages_that_say_nothing_keep_the_window_of_old(tmp_path: Path) -> None:
    job = _job(tmp_path)  # 64 microbatches a step
    assert job.runtime.max_in_flight == "auto"
    assert window(job, []) == DEFAULT_WINDOW  # no view of the stages yet
    assert window(job, [[0, 0], [0], [0]]) == DEFAULT_WINDOW  # CPU peers at their default
    assert window(_job(tmp_path, stages=1), [[30, 30]]) == DEFAULT_WINDOW  # nothing keeps any
    # never more than a step holds: four microbatches a step, four in flight at most
    assert window(_job(tmp_path, batch=16), [[0], [0], [0]]) == 4


def test_the_narrowest_keeping_stage_over_its_replicas_sizes_it(tmp_path: Path) -> None:
    job = _job(tmp_path)
    # stage 0 holds 12 + 20, stage 1 holds 18; the last stage keeps nothing, whatever it says
    assert window(job, [[12, 20], [18], [1]]) == 18
    assert window(job, [[12, 20], [10, 11], [0]]) == 21
    # a stage none of whose replicas said counts as the window of old
    assert window(job, [[40], [0, 0], [0]]) == DEFAULT_WINDOW
    # a replica that has not said yet adds nothing to its stage's sum
    assert window(job, [[40], [12, 0], [0]]) == 12


def test_floored_at_a_microbatch_per_stage_capped_and_within_the_live_microbatches(
    tmp_path: Path,
) -> None:
    deep = _job(tmp_path, stages=6, model={"n_layers": 4})
    assert window(deep, [[1], [1], [2], [1], [1], [0]]) == 6  # a shallower window idles stages
    job = _job(tmp_path, runtime={"activation_cache": 1000})
    assert window(job, [[900], [900], [0]]) == AUTO_CAP
    small = _job(tmp_path, batch=40)  # ten microbatches a step
    assert live_microbatches(small) == 10
    assert window(small, [[30], [30], [0]]) == 10
    evaluated = _job(tmp_path, batch=40, training={"eval_every": 2, "eval_microbatches": 3})
    assert live_microbatches(evaluated) == 13  # the step's validation microbatches too
    delayed = _job(tmp_path, batch=40, training={"delayed_update": True})
    assert live_microbatches(delayed) == 20  # the next step opens before this one is applied
    assert window(delayed, [[30], [30], [0]]) == 20


def test_a_replica_counts_at_most_the_jobs_activation_cache(tmp_path: Path) -> None:
    job = _job(tmp_path, runtime={"activation_cache": 5})
    assert window(job, [[40, 40], [40], [0]]) == 5


@pytest.mark.parametrize("value", [0, MAX_ANNOUNCED_CAPACITY + 1, 2**32 - 1])
def test_an_implausible_capacity_is_not_said(value: int) -> None:
    assert plausible_capacity(value) == 0
    assert plausible_capacity(MAX_ANNOUNCED_CAPACITY) == MAX_ANNOUNCED_CAPACITY
