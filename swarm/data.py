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

from swarm.config import JobConfig, token_width

__all__ = ["DataSource", "SyntheticData", "TextData", "TokenData", "make_data", "microbatch_seed"]


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

    def __init__(self, path: Path, seq_len: int, microbatch_size: int, seed: int) -> None:
        size = Path(path).stat().st_size
        if size < seq_len + 2:
            raise ValueError(f"{path} has {size} bytes; a sample needs {seq_len + 2}")
        with open(path, "rb") as f:
            # Copy-on-write: torch wants a writable buffer; nothing is ever written to it.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tokens = torch.frombuffer(self._map, dtype=torch.uint8)
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(microbatch_seed(self.seed, step, index))
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high, (self.microbatch_size,), generator=gen)
        window = torch.arange(self.seq_len + 1)
        rows = self.tokens[starts[:, None] + window[None, :]].to(torch.int64)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenData:
    """Token ids in a flat file (`swarm prepare-data`: uint16, or uint32 for vocabularies over
    65,536); each sample is a window at a random offset. Memory-mapped, never loaded whole:
    only a microbatch's windows are read and widened to int64."""

    def __init__(
        self, path: Path, vocab_size: int, seq_len: int, microbatch_size: int, seed: int
    ) -> None:
        dtype = np.uint16 if token_width(vocab_size) == 2 else np.uint32
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        if len(self.tokens) < seq_len + 2:
            raise ValueError(f"{path} has {len(self.tokens)} tokens; a sample needs {seq_len + 2}")
        self.path, self.vocab_size = path, vocab_size
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(microbatch_seed(self.seed, step, index))
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high, (self.microbatch_size,), generator=gen).tolist()
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


def make_data(job: JobConfig) -> DataSource:
    t = job.training
    if job.data.kind == "text":
        assert job.data.path is not None  # validated by the config
        return TextData(Path(job.data.path), job.model.seq_len, t.microbatch_size, t.seed)
    if job.data.kind == "tokens":
        assert job.data.path is not None
        m = job.model
        return TokenData(Path(job.data.path), m.vocab_size, m.seq_len, t.microbatch_size, t.seed)
    return SyntheticData(job.model.vocab_size, job.model.seq_len, t.microbatch_size, t.seed)
