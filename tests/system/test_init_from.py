"""Fine-tuning from a Hugging Face checkpoint over real stage servers (`[model] init_from`),
float64-exact. The checks in one process: tests/swarm/model/test_init_from.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.job.config import load_job
from swarm.local.procs import start_stage_servers, stop_all
from swarm.model.transformer import build_model
from tests.support.cli import swarm
from tests.support.equality import assert_states_within, local_state
from tests.support.pretrained import write_finetune, write_pretrained


@pytest.mark.slow
def test_fine_tuning_over_stage_servers_equals_swarm_local(tmp_path: Path) -> None:
    write_pretrained(tmp_path)
    job = write_finetune(tmp_path)
    servers = start_stage_servers(job, 3, log_dir=tmp_path)
    try:
        addresses = ",".join(s.address for s in servers)
        out = tmp_path / "swarm.pt"
        swarm("trainer", "--job", str(job), "--stage-servers", addresses, "--out", str(out))
    finally:
        stop_all(servers)
    state = torch.load(out)
    assert_states_within(state, local_state(job), tol=1e-9)
    start = build_model(load_job(job)).state_dict()
    assert max((state[k] - v).abs().max().item() for k, v in start.items()) > 1e-4  # it trained
