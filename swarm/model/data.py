"""Training data as a pure function of `(seed, step, index)`.

Microbatch `(step, index)` always gets the same samples, whichever trainer computes it and however
often it is replayed; that is what lets a failed microbatch be replayed exactly and lets the
reference (`swarm local`) see the very same data. The data position of a job is therefore just its
step.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from swarm.errors import ConfigError
from swarm.job.coerce import show
from swarm.job.config import JobConfig, token_width

__all__ = [
    "VAL_STEP",
    "DataSource",
    "SyntheticData",
    "TextData",
    "TokenData",
    "check_token_ids",
    "make_data",
    "make_val_data",
    "microbatch_seed",
]

# The step validation microbatch `(VAL_STEP, i)` is drawn for: never a training step, so the
# validation set is fixed for the whole job and shares no seed with a training microbatch.
VAL_STEP = -1


class DataSource(Protocol):
    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inputs, targets)`, both int64 `[microbatch_size, seq_len]`, targets shifted by one."""
        ...


def microbatch_seed(seed: int, step: int, index: int) -> int:
    digest = hashlib.blake2b(f"swarm-data/{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TextData:
    """Byte-level tokens of a UTF-8 file; each sample is a window at a random offset.

    The file is memory-mapped and its tokens stay bytes (uint8): a corpus costs its size in page
    cache, shared by every trainer on the machine, not eight times that as int64. Only a
    microbatch's windows are widened to int64."""

    def __init__(
        self,
        path: Path,
        seq_len: int,
        microbatch_size: int,
        seed: int,
        part: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        size = Path(path).stat().st_size
        if size < seq_len + 2:
            raise ValueError(f"{path} has {size} bytes; a sample needs {seq_len + 2}")
        with open(path, "rb") as f:
            # Copy-on-write: torch wants a writable buffer; nothing is ever written to it.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tokens = torch.frombuffer(self._map, dtype=torch.uint8)
        self.low, self.high = _span(path, len(self.tokens), part, seq_len)
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(microbatch_seed(self.seed, step, index))
        starts = torch.randint(self.low, self.high, (self.microbatch_size,), generator=gen)
        window = torch.arange(self.seq_len + 1)
        rows = self.tokens[starts[:, None] + window[None, :]].to(torch.int64)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenData:
    """Token ids in a flat file (`swarm prepare-data`: uint16, or uint32 for vocabularies over
    65,536); each sample is a window at a random offset. Memory-mapped, never loaded whole:
    only a microbatch's windows are read and widened to int64."""

    def __init__(
        self,
        path: Path,
        vocab_size: int,
        seq_len: int,
        microbatch_size: int,
        seed: int,
        part: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        self.tokens = _token_map(path, vocab_size)
        if len(self.tokens) < seq_len + 2:
            raise ValueError(f"{path} has {len(self.tokens)} tokens; a sample needs {seq_len + 2}")
        self.low, self.high = _span(path, len(self.tokens), part, seq_len)
        self.path, self.vocab_size = path, vocab_size
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(microbatch_seed(self.seed, step, index))
        size = (self.microbatch_size,)
        starts = torch.randint(self.low, self.high, size, generator=gen).tolist()
        rows = torch.from_numpy(
            np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        )
        if int(rows.max()) >= self.vocab_size:  # a file made with a larger vocabulary
            raise ValueError(
                f"{self.path} holds token id {int(rows.max())}, outside model.vocab_size = "
                f"{self.vocab_size}: use the vocabulary size of the tokenizer that made it"
            )
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class SyntheticData:
    """Learnable sequences with no file: each sample counts up from a random start by a random
    stride modulo the vocabulary, so the next token follows from the previous two."""

    def __init__(self, vocab_size: int, seq_len: int, microbatch_size: int, seed: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.microbatch_size, self.seed = microbatch_size, seed

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(microbatch_seed(self.seed, step, index))
        b = self.microbatch_size
        start = torch.randint(0, self.vocab_size, (b, 1), generator=gen)
        stride = torch.randint(1, 8, (b, 1), generator=gen)
        rows = (start + stride * torch.arange(self.seq_len + 1)[None, :]) % self.vocab_size
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _token_map(path: Path, vocab_size: int) -> np.memmap:
    return np.memmap(path, dtype=np.uint16 if token_width(vocab_size) == 2 else np.uint32, mode="r")


def _check_ids(tokens: np.ndarray, path: Path, vocab_size: int) -> None:
    """Every id of a token file inside the vocabulary (numpy's pass over the file, a fraction
    of its hashing): a file made with a larger tokenizer failed only at the step whose
    microbatch drew such an id, hours in."""
    largest = int(tokens.max()) if len(tokens) else -1
    if largest >= vocab_size:
        raise ConfigError(
            f"the token file {show(str(path))} holds token id {largest}, outside "
            f"model.vocab_size = {vocab_size}: use the vocabulary size of the tokenizer that "
            "made it"
        )


def check_token_ids(job: JobConfig) -> None:
    """`ConfigError` unless every id of a token job's data files is inside its vocabulary.
    Checked once per job where it enters (the scheduler's submission, `swarm local`, a trainer
    given a job file), off any event loop: a large file costs seconds. A job from a scheduler
    is checked already (its data pinned by its hash), and a microbatch past the vocabulary is
    still refused as it is drawn."""
    if job.data.kind != "tokens":
        return
    vocab = job.model.vocab_size
    for path in (job.data.path, job.data.val_path):
        if path is not None:
            _check_ids(_token_map(Path(path), vocab), Path(path), vocab)


def _span(path: Path, length: int, part: tuple[float, float], seq_len: int) -> tuple[int, int]:
    """The window starts `[low, high)` of the part of a file of `length` tokens between the
    fractions `part`: every window of `seq_len + 1` tokens lies inside it."""
    low, end = int(length * part[0]), int(length * part[1])
    if end - low < seq_len + 2:
        which = "training" if part[0] == 0 else "validation"
        raise ConfigError(
            f"the {which} part of {path} ({low}..{end} of {length} tokens) is shorter than a "
            f"sample ({seq_len + 2} tokens); change data.val_fraction"
        )
    return low, end - seq_len - 1


def _from_file(job: JobConfig, path: Path, part: tuple[float, float]) -> DataSource:
    m, t = job.model, job.training
    if job.data.kind == "text":
        return TextData(path, m.seq_len, t.microbatch_size, t.seed, part)
    return TokenData(path, m.vocab_size, m.seq_len, t.microbatch_size, t.seed, part)


def make_data(job: JobConfig) -> DataSource:
    """The training data: the data file, less the tail `data.val_fraction` holds out."""
    t = job.training
    if job.data.kind == "synthetic":
        return SyntheticData(job.model.vocab_size, job.model.seq_len, t.microbatch_size, t.seed)
    assert job.data.path is not None  # validated by the config
    return _from_file(job, Path(job.data.path), (0.0, 1.0 - job.data.val_fraction))


def make_val_data(job: JobConfig) -> DataSource:
    """The validation data, microbatch `(VAL_STEP, i)` for each evaluated `i`: `data.val_path`,
    or the tail of the data file `data.val_fraction` holds out, or (neither set) windows of the
    training data drawn apart from any training microbatch."""
    d = job.data
    if d.val_path is not None:
        return _from_file(job, Path(d.val_path), (0.0, 1.0))
    if d.val_fraction:
        assert d.path is not None
        return _from_file(job, Path(d.path), (1.0 - d.val_fraction, 1.0))
    return make_data(job)
