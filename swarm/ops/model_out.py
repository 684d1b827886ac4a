"""What a training command writes (`swarm local`, `swarm trainer --stage-servers`), opened before
it trains: a path it cannot write is a one-line error then, not a traceback after the training
with the trained model, held only in memory, lost (`writable`).

The model's file (`ModelOut`, `--out`) is written to a temporary file beside its name and
renamed into place: the name gets a whole file or keeps what it had. `torch.save` to the name
truncated a previous model first, and a full disk left a torn one there."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

from swarm.errors import SwarmError

__all__ = ["ModelOut", "writable"]


def writable(flag: str, path: Path, mode: str, at: Path | None = None) -> IO[Any]:
    """`flag`'s `path` opened in `mode` (at `at`, its temporary file, where given), or the
    flag's error in one line."""
    try:
        return open(at or path, mode)  # the caller closes it
    except OSError as e:
        raise SwarmError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


class ModelOut:
    """A model's file `out`, given by `flag`: its temporary file opened now (`writable`), the
    model written whole by `write`; the temporary file goes with `close` unless it holds the
    only copy of a model its rename failed to place."""

    def __init__(self, flag: str, out: Path) -> None:
        if out.is_dir():  # its temporary file writes, its name never replaces
            raise SwarmError(f"{flag} {out}: cannot write it (a directory)")
        self.flag, self.out = flag, out
        self.partial = out.with_name(f".{out.name}.partial")
        self._file = writable(flag, out, "wb", self.partial)
        self._kept = False

    def write(self, state: dict[str, torch.Tensor]) -> None:
        """`torch.save(state)` under the name, whole (SwarmError, in one line, where not)."""
        try:
            torch.save(state, self._file)
            self._file.close()
        except (OSError, RuntimeError) as e:  # a full disk (torch's writer: RuntimeError)
            raise SwarmError(
                f"{self.flag} {self.out}: cannot write it ({getattr(e, 'strerror', None) or e})"
            ) from None
        try:
            os.replace(self.partial, self.out)
        except OSError as e:  # another's file in a sticky directory, say
            self._kept = True
            raise SwarmError(
                f"{self.flag} {self.out}: cannot write it ({e.strerror or e}); the model is "
                f"kept at {self.partial}"
            ) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        if not self._kept:
            self.partial.unlink(missing_ok=True)

    def __enter__(self) -> ModelOut:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
