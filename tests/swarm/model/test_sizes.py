"""A stage's size counted on the meta device (`swarm.model.sizes`) is the one a built stage has:
what the scheduler and peers refuse a job by must not be an estimate that drifts."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.model.footprint import layer_activation_bytes
from swarm.model.sizes import format_bytes, stage_parameters, stage_state_bytes
from swarm.model.transformer import build_stage
from tests.support.jobs import make_job


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_counted_stages_are_the_built_ones(tmp_path: Path, kind: str) -> None:
    job = make_job(tmp_path, model={"kind": kind, "n_layers": 3}, training={"stages": 3})
    built = [sum(p.numel() for p in build_stage(job, s).parameters()) for s in range(3)]
    assert stage_parameters(job) == built
    # float64, AdamW: weights, gradient sums and two moments, 8 bytes each.
    assert stage_state_bytes(job) == [n * 8 * 4 for n in built]


@pytest.mark.parametrize("key", ["boundary_rank", "boundary_bottleneck"])
def test_a_small_boundary_job_is_counted_as_built(tmp_path: Path, key: str) -> None:
    """What admission counts at submit: a small boundary's job was refused there with the
    one-stage model `layer_parameters` counts on (no boundary to narrow in one stage)."""
    job = make_job(tmp_path, model={"n_layers": 4, key: 4}, training={"stages": 3})
    built = [sum(p.numel() for p in build_stage(job, s).parameters()) for s in range(3)]
    assert stage_parameters(job) == built
    plain = make_job(tmp_path, model={"n_layers": 4}, training={"stages": 3})
    assert layer_activation_bytes(job) == layer_activation_bytes(plain)  # the layers' own


def test_the_attacks_model_is_counted_without_building_it(tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        model={"d_model": 8192, "n_layers": 4096, "n_heads": 64},
        training={"stages": 8, "dtype": "float32"},
    )
    assert 3.29e12 < sum(stage_parameters(job)) < 3.31e12
    assert format_bytes(max(stage_state_bytes(job))) == "6.0 TiB"
    assert format_bytes(100) == "100 B" and format_bytes(1536) == "1.5 KiB"
