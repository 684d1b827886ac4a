"""Real processes: 4 stage servers and a trainer, each `swarm ...` started as its own process,
train a job and end with `swarm local`'s parameters."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import torch

from swarm.local.procs import start_stage_servers, stop_all
from swarm.model import checkpoint
from tests.support.cli import swarm_forked
from tests.support.equality import assert_states_within
from tests.support.jobs import write_job

pytestmark = pytest.mark.slow


def _calls(metrics_port: str) -> dict[str, float]:
    """Per method, the calls a stage server answered OK (its Prometheus counter)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    pattern = r'^swarm_stage_requests_total\{[^}]*method="(\w+)"[^}]*\} (\S+)$'
    calls: dict[str, float] = {}
    for line in text.splitlines():
        found = re.match(pattern, line)
        if found and 'code="OK"' in line:
            calls[found[1]] = calls.get(found[1], 0.0) + float(found[2])
    return calls


def _records(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("dtype", "plane", "model"),
    [
        ("float64", "relay", "gpt"),
        ("float32", "relay", "gpt"),
        ("float64", "push", "gpt"),
        ("float64", "push", "llama"),
        ("bf16-mixed", "push", "llama"),
    ],
)
def test_four_stage_servers_equal_local(tmp_path: Path, dtype: str, plane: str, model: str) -> None:
    mixed = dtype == "bf16-mixed"  # float32 weights, bf16 compute and wire
    job = write_job(
        tmp_path,
        model={"kind": "llama", "n_heads": 4, "n_kv_heads": 2} if model == "llama" else {},
        training={
            "stages": 4,
            "steps": 10,
            "dtype": "float32" if mixed else dtype,
            "precision": "bf16-mixed" if mixed else "fp32",
            "target_batch_size": 24,
            "microbatch_size": 4,
            "checkpoint_every": 5,
            "eval_every": 4,
            "eval_microbatches": 2,
        },
        runtime={"max_in_flight": 4, "data_plane": plane},
        compression={"wire": "bf16" if mixed else "none"},
    )
    servers = start_stage_servers(job, 4, log_dir=tmp_path)
    try:
        addresses = ",".join(s.address for s in servers)
        swarm_forked(
            "trainer",
            "--job",
            str(job),
            "--stage-servers",
            addresses,
            "--out",
            str(tmp_path / "swarm.pt"),
            "--log",
            str(tmp_path / "swarm.jsonl"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            # A scheduler exported for other commands: --stage-servers still means standalone.
            env={"SWARM_SCHEDULER": "127.0.0.1:1"},
            log_dir=tmp_path,
            name="trainer",
            timeout=600,
        )
        # The plane asked for is the one used: a middle stage got pushes, or relayed calls.
        calls = _calls(servers[1].ready["metrics"])
        used = {m for m in ("Push", "Forward", "Backward") if calls.get(m)}
        assert used == ({"Push"} if plane == "push" else {"Forward", "Backward"}), calls
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0, 0, 0], "stage servers must shut down cleanly on SIGTERM"
    assert checkpoint.latest(tmp_path / "ckpt") == 10
    assert all("Traceback" not in s.log() for s in servers), servers[0].log()[-2000:]
    swarm_forked(
        "local",
        str(job),
        "--out",
        str(tmp_path / "local.pt"),
        "--log",
        str(tmp_path / "local.jsonl"),
        # One torch thread, as the stage servers have: its default, one per core, only contends
        # on a busy machine (over 3 s a step of this tiny model, against milliseconds).
        "--threads",
        "1",
        log_dir=tmp_path,
        name="local",
        timeout=600,
    )

    # Validation losses at steps 0, 4 and 8 (of the parameters each step trained from) and of
    # the trained parameters (a record of its own, after step 9), as `swarm local` computes them.
    swarm_evals, local_evals = (
        [(r["step"], r["val_loss"]) for r in _records(tmp_path / log) if r["val_loss"] is not None]
        for log in ("swarm.jsonl", "local.jsonl")
    )
    assert [s for s, _ in swarm_evals] == [s for s, _ in local_evals] == [0, 4, 8, 10]
    assert swarm_evals[-1][1] < swarm_evals[0][1], "the validation loss should fall"
    for (_, a), (_, b) in zip(swarm_evals, local_evals, strict=True):
        assert abs(a - b) <= (1e-9 if dtype == "float64" else 1e-2 if mixed else 1e-4) * b
    swarm_records, local_records = (
        [r for r in _records(tmp_path / log) if r["samples"]]
        for log in ("swarm.jsonl", "local.jsonl")
    )
    swarm_losses, local_losses = ([r["loss"] for r in rs] for rs in (swarm_records, local_records))
    assert len(swarm_losses) == len(local_losses) == 10
    assert swarm_losses[-1] < swarm_losses[0], "the loss should fall"
    # bf16-mixed: the swarm rounds each stage's output and its gradient to bf16 on the wire,
    # `swarm local` does not; the same compute otherwise.
    rel = 1e-2 if mixed else 1e-4
    for a, b in zip(swarm_losses, local_losses, strict=True):
        assert abs(a - b) <= rel * abs(b)
    # Each step's tokens and gradient norm (the coordinator's, from the stages' PREPAREs) as
    # `swarm local` logs them.
    for a, b in zip(swarm_records, local_records, strict=True):
        assert a["tokens"] == b["tokens"] == 24 * 16
        tol = 1e-9 if dtype == "float64" else 10 * rel
        assert abs(a["grad_norm"] - b["grad_norm"]) <= tol * b["grad_norm"], (a, b)
    swarm_state = torch.load(tmp_path / "swarm.pt")
    local_state = torch.load(tmp_path / "local.pt")
    assert swarm_state.keys() == local_state.keys()
    if dtype == "float64":
        assert_states_within(swarm_state, local_state, tol=1e-9)


def test_trainer_refuses_servers_of_another_job(tmp_path: Path) -> None:
    job = write_job(tmp_path, "a", training={"stages": 2})
    other = write_job(tmp_path, "b", training={"stages": 2, "seed": 5})
    servers = start_stage_servers(job, 2, log_dir=tmp_path, metrics=False)
    try:
        code, said = swarm_forked(
            "trainer",
            "--job",
            str(other),
            "--stage-servers",
            ",".join(s.address for s in servers),
            log_dir=tmp_path,
            name="trainer",
            timeout=120,
            check=False,
        )
    finally:
        stop_all(servers)
    assert code != 0
    assert "same job file on both sides?" in said
