"""`training.tf32`: off unless a job says (float32 stays exact against the reference), and a job
that leaves it off keeps the fingerprint it had before the key existed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from swarm.job.config import load_job
from swarm.job.fingerprint import fingerprint

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny.toml"


def test_tf32_is_off_by_default_and_counts_only_when_on() -> None:
    job = load_job(TINY)
    assert job.training.tf32 is False
    assert fingerprint(job) == "65d351797e29b399"  # examples/tiny.toml's before tf32 existed
    on = replace(job, training=replace(job.training, tf32=True))
    assert fingerprint(on) != fingerprint(job), "TF32 changes the maths"


def test_tf32_read_from_a_job_file(tmp_path: Path) -> None:
    text = TINY.read_text().replace('dtype = "float32"', 'dtype = "float32"\ntf32 = true')
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    (tmp_path / "data").symlink_to(TINY.parent / "data")
    assert load_job(path).training.tf32 is True
