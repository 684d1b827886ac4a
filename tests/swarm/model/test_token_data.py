"""Token datasets: `swarm prepare-data` tokenizes text with a real Hugging Face `tokenizers` file
(or as bytes) into a flat file of uint16/uint32 ids; a `[data] kind = "tokens"` job memory-maps it,
pins it by sha256 like text, and trains on it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from swarm.cli import main
from swarm.errors import ConfigError
from swarm.job.config import load_job
from swarm.model.data import TokenData, check_token_ids, make_data
from swarm.model.prepare import prepare_data
from swarm.model.reference import train_local
from tests.support.jobs import write_job

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "data" / "corpus.txt"


def _bpe(tmp_path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained here on the bundled corpus (no download)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(CORPUS)], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _job(tmp_path: Path, data: Path, vocab_size: int, steps: int = 3) -> Path:
    return write_job(
        tmp_path,
        "tokens",
        model={"vocab_size": vocab_size, "seq_len": 32},
        data={"kind": "tokens", "path": str(data)},
        training={"stages": 2, "steps": steps, "dtype": "float32"},
        optimizer={"lr": 3e-3},
    )


def test_prepare_data_writes_the_tokenizers_ids_and_a_job_learns_from_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = _bpe(tmp_path)
    half = CORPUS.read_bytes()[:60_000]
    (tmp_path / "a.txt").write_bytes(half[:30_000].rsplit(b"\n", 1)[0] + b"\n")
    (tmp_path / "b.txt").write_bytes(half[30_000:].split(b"\n", 1)[1])
    out = tmp_path / "data.bin"
    argv = ["prepare-data", "a.txt", "b.txt", "--tokenizer", "tokenizer.json", "--out", "data.bin"]
    argv = [str(tmp_path / a) if a.endswith((".txt", ".json", ".bin")) else a for a in argv]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer.from_file(str(tokenizer))
    want = [i for f in ("a.txt", "b.txt") for i in tok.encode((tmp_path / f).read_text()).ids]
    ids = np.fromfile(out, dtype=np.uint16)
    assert ids.tolist() == want  # one chunk per file here: exactly the tokenizer's ids
    assert f"{len(want)} tokens as uint16 (vocabulary 300)" in printed
    assert hashlib.sha256(out.read_bytes()).hexdigest() in printed
    assert not list(tmp_path.glob(".*partial"))
    job = load_job(_job(tmp_path, out, 300, steps=40))
    assert job.data.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()  # pinned like text
    data = make_data(job)
    assert isinstance(data, TokenData) and isinstance(data.tokens, np.memmap)  # never loaded
    inputs, targets = data.microbatch(3, 1)
    assert inputs.shape == (4, 32) and bool((inputs[:, 1:] == targets[:, :-1]).all())
    losses: list[float] = []
    train_local(job, on_step=lambda r: losses.append(r.loss))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_without_a_tokenizer_the_bytes_are_the_tokens_and_large_files_go_in_chunks(
    tmp_path: Path,
) -> None:
    text = CORPUS.read_bytes() * 15  # over a megabyte: several chunks, cut at line ends
    assert len(text) > 1 << 20
    (tmp_path / "big.txt").write_bytes(text)
    seen: list[int] = []
    done = prepare_data([tmp_path / "big.txt"], tmp_path / "bytes.bin", on_bytes=seen.append)
    assert (done.tokens, done.vocab_size, done.width) == (len(text), 256, 2)
    assert len(seen) > 1 and sum(seen) == len(text)
    assert (
        np.fromfile(tmp_path / "bytes.bin", dtype=np.uint16).tobytes()
        == np.frombuffer(text, np.uint8).astype(np.uint16).tobytes()
    )


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path: Path) -> None:
    words = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    text = " ".join(f"w{(i * 7919) % 70_000}" for i in range(200)) + "\n"
    (tmp_path / "w.txt").write_text(text)
    done = prepare_data([tmp_path / "w.txt"], tmp_path / "w.bin", tmp_path / "words.json")
    assert (done.width, done.vocab_size, done.tokens) == (4, 70_001, 200)
    ids = np.fromfile(tmp_path / "w.bin", dtype=np.uint32)
    assert ids.tolist() == [(i * 7919) % 70_000 for i in range(200)]
    job = load_job(_job(tmp_path, tmp_path / "w.bin", 70_001))
    inputs, _ = make_data(job).microbatch(0, 0)
    assert int(inputs.max()) > 65_535  # read as 32-bit ids


def test_bad_token_files_are_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01" * 201)  # not a whole number of uint16 ids
    with pytest.raises(ConfigError, match="not a whole number of 2-byte ids"):
        load_job(_job(tmp_path, tmp_path / "odd.bin", 256))
    # an id past the vocabulary, anywhere in the file: refused before any step (at submit, as
    # `swarm local` or a trainer given the file starts), where it failed only at the step whose
    # microbatch drew it, hours in
    ids = np.full(700_000, 7, np.uint16)
    ids[600_000] = 900
    (tmp_path / "big.bin").write_bytes(ids.tobytes())
    big = _job(tmp_path, tmp_path / "big.bin", 256)
    with pytest.raises(ConfigError, match=r"holds token id 900, outside model\.vocab_size = 256"):
        check_token_ids(load_job(big))
    assert main(["local", str(big), "--threads", "1"]) == 2
    assert "holds token id 900" in capsys.readouterr().err
    # and one the file gained after its job loaded: refused as a microbatch draws it
    (tmp_path / "late.bin").write_bytes(np.full(200, 7, np.uint16).tobytes())
    data = make_data(load_job(_job(tmp_path, tmp_path / "late.bin", 256)))
    (tmp_path / "late.bin").write_bytes(np.full(200, 900, np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"token id 900, outside model\.vocab_size = 256"):
        data.microbatch(0, 0)
    with pytest.raises(ConfigError, match="no such file"):
        prepare_data([tmp_path / "missing.txt"], tmp_path / "x.bin")
    with pytest.raises(ConfigError, match="is not a tokenizers file"):
        prepare_data([tmp_path / "odd.bin"], tmp_path / "x.bin", tmp_path / "odd.bin")
    assert not (tmp_path / "x.bin").exists()
