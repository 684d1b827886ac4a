"""The job's boundary, chosen once (`swarm.model.boundary.boundary_of`): what crosses with the
hidden state, and how the targets and ids travel, for each kind of boundary."""

from __future__ import annotations

from pathlib import Path

import torch

from swarm.model.boundary import Boundary, SubspaceBoundary, boundary_of
from swarm.model.subspace import wire_targets, wire_tokens
from tests.support.jobs import make_job

IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def test_a_full_boundary_sends_the_hidden_state_alone(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    boundary = boundary_of(job.model)
    assert type(boundary) is Boundary and not boundary.needs_tokens
    assert boundary.width == job.model.d_model
    assert boundary.tokens(IDS) is None
    assert boundary.targets(IDS) is IDS and boundary.widened(IDS) is IDS
    assert boundary_of(job.model) is boundary, "one object per model: chosen once"


def test_a_bottleneck_crosses_at_its_width_without_the_ids(tmp_path: Path) -> None:
    job = make_job(tmp_path, model={"boundary_bottleneck": 8})
    boundary = boundary_of(job.model)
    assert type(boundary) is Boundary and boundary.width == 8
    assert boundary.tokens(IDS) is None


def test_a_subspace_boundary_sends_the_ids_beside_and_the_targets_narrow(tmp_path: Path) -> None:
    job = make_job(tmp_path, model={"boundary_rank": 4})
    boundary = boundary_of(job.model)
    assert isinstance(boundary, SubspaceBoundary) and boundary.needs_tokens
    assert boundary.width == 4 and str(boundary) == "model.boundary_rank = 4"
    vocab = job.model.vocab_size
    tokens = boundary.tokens(IDS)
    assert tokens is not None and tokens.equal(wire_tokens(IDS, vocab))
    assert tokens.dtype == wire_tokens(IDS, vocab).dtype != torch.int64
    narrow = boundary.targets(IDS)
    assert narrow.equal(wire_targets(IDS, 4, vocab)) and narrow.dtype == tokens.dtype
    assert boundary.widened(narrow).dtype == torch.int64 and boundary.widened(narrow).equal(IDS)
