"""`swarm prepare-data`: text files tokenized into one flat file of token ids, the data of a job
with `[data] kind = "tokens"` (`swarm.model.data.TokenData` memory-maps it).

The ids are uint16 when the vocabulary fits (65,536 ids), else uint32 (`swarm.job.config.
token_width`), one file after the other, with no header: the job's `model.vocab_size` (at least
the tokenizer's) says which. The tokenizer is a Hugging Face `tokenizers` file (`tokenizer.json`)
the user supplies; without one the bytes are the tokens (vocabulary 256). Files are read in
chunks cut at line ends, so memory stays bounded whatever their size; the output is written
beside its final name and renamed into place, so an interrupted run leaves no partial file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swarm.errors import ConfigError
from swarm.job.config import token_width

__all__ = ["Prepared", "prepare_data"]

_CHUNK = 1 << 20  # bytes of text per encode call


@dataclass(frozen=True)
class Prepared:
    path: Path
    tokens: int
    vocab_size: int  # the tokenizer's, added tokens included: model.vocab_size must be >= it
    width: int  # bytes per id
    sha256: str


def _chunks(path: Path) -> Iterator[bytes]:
    """The file in pieces of about `_CHUNK` bytes, each ending at a line end (or the file's)."""
    with open(path, "rb") as f:
        rest = b""
        while block := f.read(_CHUNK):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # one long line: keep reading
                rest = block
                continue
            rest = block[cut:]
            yield block[:cut]
        if rest:
            yield rest


def prepare_data(
    files: list[Path],
    out: Path,
    tokenizer: Path | None = None,
    on_bytes: Callable[[int], object] = lambda n: None,
) -> Prepared:
    """Tokenize `files` in order into `out`; `on_bytes(n)` after each n bytes of text read."""
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"no such file: {', '.join(missing)}")
    encode: Callable[[bytes], object]
    if tokenizer is None:
        vocab = 256

        def encode(text: bytes) -> object:
            return np.frombuffer(text, np.uint8)
    else:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(tokenizer))
        except Exception as e:  # the library raises its own types for bad files
            raise ConfigError(f"{tokenizer} is not a tokenizers file: {e}") from None
        vocab = tok.get_vocab_size(with_added_tokens=True)

        def encode(text: bytes) -> object:
            return tok.encode(text.decode("utf-8", errors="replace")).ids

    width = token_width(vocab)
    dtype = np.uint16 if width == 2 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    digest, count = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for path in files:
                for chunk in _chunks(Path(path)):
                    data = np.asarray(encode(chunk), dtype=dtype).tobytes()
                    f.write(data)
                    digest.update(data)
                    count += len(data) // width
                    on_bytes(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return Prepared(out, count, vocab, width, digest.hexdigest())
