"""Evaluation: `[training] eval_every` runs fixed validation microbatches forward only, and the
validation data is held out (`data.val_fraction`: the data file's tail; `data.val_path`: a file
of its own, pinned by hash like the data). The pipeline's figures against `swarm local` are in
tests/system/test_pipeline_integration.py; here the data split, the reference's rule, the record
kept by the scheduler's store and what the progress bar shows."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from scheduler.store import JobStore
from swarm.errors import ConfigError, InvalidArgument
from swarm.job.config import load_job
from swarm.job.fingerprint import fingerprint
from swarm.model.data import VAL_STEP, make_data, make_val_data
from swarm.model.reference import train_local
from swarm.ops.progress import StepLog, StepRecord
from tests.support.jobs import BASE, render, write_job
from tests.support.store_schema import as_before

SEQ = BASE["model"]["seq_len"]


def _tokens(tmp_path: Path, name: str, values: np.ndarray) -> Path:
    path = tmp_path / name
    values.astype(np.uint16).tofile(path)
    return path


def _job(tmp_path: Path, name: str = "test", **data: object) -> Path:
    return write_job(tmp_path, name, data={"kind": "tokens", **data})


def test_val_fraction_holds_the_tail_of_the_file_out_of_training(tmp_path: Path) -> None:
    # The first 900 ids are even, the last 100 odd: a window that crosses into the tail, or
    # a validation window outside it, would show an id of the other kind.
    rng = np.random.default_rng(0)
    ids = np.concatenate([2 * rng.integers(0, 32, 900), 2 * rng.integers(0, 32, 100) + 1])
    _tokens(tmp_path, "data.bin", ids)
    job = load_job(_job(tmp_path, path="data.bin", val_fraction=0.1))
    train, val = make_data(job), make_val_data(job)
    for step in range(20):
        for index in range(4):
            inputs, targets = train.microbatch(step, index)
            assert (inputs % 2 == 0).all() and (targets % 2 == 0).all()
    for index in range(20):
        inputs, targets = val.microbatch(VAL_STEP, index)
        assert (inputs % 2 == 1).all() and (targets % 2 == 1).all()
    # The split changes what is trained on, so it names another job; no split keeps the old.
    whole = load_job(_job(tmp_path, "whole", path="data.bin"))
    assert fingerprint(job) != fingerprint(whole)
    assert fingerprint(whole) == fingerprint(load_job(_job(tmp_path, "again", path="data.bin")))


def test_without_a_split_validation_windows_are_drawn_apart_from_training(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, "synthetic"))
    val, train = make_val_data(job), make_data(job)
    first = val.microbatch(VAL_STEP, 0)[0]
    assert (first == val.microbatch(VAL_STEP, 0)[0]).all()  # fixed for the whole job
    assert not any((first == train.microbatch(s, i)[0]).all() for s in range(5) for i in range(4))


def test_a_validation_file_is_pinned_like_the_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    _tokens(tmp_path, "data.bin", rng.integers(0, 64, 500))
    val_file = _tokens(tmp_path, "val.bin", np.full(200, 63))
    path = _job(tmp_path, path="data.bin", val_path="val.bin")
    job = load_job(path)
    assert job.data.val_sha256 is not None and job.data.val_path == val_file
    assert (make_val_data(job).microbatch(VAL_STEP, 2)[0] == 63).all()
    # Not trained on: the fingerprint is the data's, with or without a validation file.
    assert fingerprint(job) == fingerprint(load_job(_job(tmp_path, "plain", path="data.bin")))
    pinned = path.read_text().replace("[data]", f'[data]\nval_sha256 = "{job.data.val_sha256}"')
    path.write_text(pinned)
    val_file.write_bytes(val_file.read_bytes()[:-2] + b"\x00\x00")
    with pytest.raises(ConfigError, match=r"data.val_sha256 = .*\(data.val_path = .*changed"):
        load_job(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "synthetic", "val_fraction": 0.1}, r"data.val_fraction = 0.1 .*text"),
        ({"path": "data.bin", "val_fraction": 1.0}, r"data.val_fraction = 1.0 .*\[0, 1\)"),
        ({"path": "data.bin", "val_fraction": 0.01}, r"validation part .* data.val_fraction"),
        ({"path": "data.bin", "val_fraction": 0.99}, r"training part .* data.val_fraction"),
        (
            {"path": "data.bin", "val_fraction": 0.1, "val_path": "data.bin"},
            r"data.val_fraction = 0.1 .*unset when data.val_path",
        ),
        ({"path": "data.bin", "val_path": "missing.bin"}, r"data.val_path = .*cannot be read"),
    ],
)
def test_bad_validation_splits_are_refused_clearly(
    tmp_path: Path, data: dict[str, object], message: str
) -> None:
    _tokens(tmp_path, "data.bin", np.arange(1000) % 64)
    path = write_job(tmp_path, data={"kind": "tokens", **data})
    with pytest.raises(ConfigError, match=message):
        job = load_job(path)
        make_data(job), make_val_data(job)


def test_the_reference_evaluates_every_eval_every_steps_and_the_trained_model(
    tmp_path: Path,
) -> None:
    training = {"stages": 2, "steps": 5, "eval_every": 2, "eval_microbatches": 3}
    records: list[StepRecord] = []
    evaluated = train_local(
        load_job(write_job(tmp_path, training=training)), on_step=records.append
    )
    plain = train_local(load_job(write_job(tmp_path, "plain", training={"steps": 5})))
    # Evaluating changes nothing trained: same parameters bit for bit.
    for (k, a), (_, b) in zip(
        evaluated.state_dict().items(), plain.state_dict().items(), strict=True
    ):
        assert (a == b).all(), k
    assert [(r.step, r.val_loss is not None) for r in records] == [
        (0, True),
        (1, False),
        (2, True),
        (3, False),
        (4, True),
        (5, True),
    ]
    final = records[-1]
    assert final.final_evaluation and final.samples == 0 and math.isnan(final.loss)
    assert final.val_loss is not None and records[0].val_loss is not None
    assert final.val_loss < records[0].val_loss


def test_the_store_keeps_the_newest_evaluation_and_a_rollback_forgets_later_ones(
    tmp_path: Path,
) -> None:
    with JobStore(tmp_path / "jobs.sqlite") as store:
        job = store.create("test", render(BASE), str(tmp_path), 6).id
        assert store.get(job).val_step == -1  # type: ignore[union-attr]
        for step, loss in ((0, 4.0), (2, 3.0), (4, 2.5), (6, 2.0)):
            store.record_eval(job, step, loss)
        store.record_eval(job, 4, 9.9)  # a retried record keeps the first
        record = store.get(job)
        assert record is not None and (record.val_step, record.val_loss) == (6, 2.0)
        store.rewind(job, 2)  # back to the checkpoint after 2 updates: its evaluation holds
        assert store.evals(job) == [(0, 4.0), (2, 3.0)]
        with pytest.raises(InvalidArgument, match=r"outside 0\.\.6"):
            store.record_eval(job, 7, 1.0)


def test_a_store_of_the_first_schema_gains_the_evaluations(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite"
    with JobStore(path) as store:
        job = store.create("test", render(BASE), str(tmp_path), 3).id
        store.record_step(job, 0, 3.0, 16, 0.1)
    as_before(path, 1)  # as a swarm of the first schema left it (no evals, no events)
    with JobStore(path) as store:
        store.record_eval(job, 1, 2.5)
        record = store.get(job)
        assert record is not None and record.loss == 3.0 and record.val_loss == 2.5


def test_the_step_log_shows_the_last_validation_loss_and_writes_every_record(
    tmp_path: Path,
) -> None:
    out = tmp_path / "log.jsonl"
    with StepLog(3, path=out, show=False) as log:
        log(StepRecord(0, 2.0, 16, 0.5, val_loss=2.5))
        log(StepRecord(1, 1.5, 16, 0.5))
        assert log._bar.postfix is not None and "val_loss=2.5000" in log._bar.postfix
        log(StepRecord(2, 1.0, 16, 0.5))
        log(StepRecord(3, math.nan, 0, 0.1, val_loss=1.25))  # the final evaluation: no step
        shown = str(log._bar.postfix)
        assert "loss=1.0000" in shown and "val_loss=1.2500" in shown  # step 2's and the final
    rows = [json.loads(line) for line in io.StringIO(out.read_text())]
    assert [r["val_loss"] for r in rows] == [2.5, None, None, 1.25]
