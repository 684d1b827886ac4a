"""Per-step records, shown as a progress bar and optionally written as JSON lines."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from tqdm import tqdm

__all__ = ["StepLog", "StepRecord", "duration_text"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float  # mean over the step's samples of each sample's mean token loss
    samples: int
    seconds: float
    tokens: int = 0  # the step's tokens trained on (samples x seq_len)
    grad_norm: float | None = None  # the whole model's averaged gradient, before clipping
    # The validation loss of the parameters this step trained from (after `step` updates), on
    # the steps `training.eval_every` names. The final evaluation, of the trained parameters,
    # is a record of its own: step = training.steps, no samples, no loss.
    val_loss: float | None = None
    # Of `seconds`, those no microbatch could be leased in because a commit was under way: the
    # whole commit (averaging included) when synchronous, the wait for the one before it with
    # `training.delayed_update`.
    blocked_seconds: float = 0.0

    @property
    def final_evaluation(self) -> bool:
        return self.samples == 0 and self.val_loss is not None

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StepLog:
    """A progress bar over steps (step, loss, samples/s) and an optional JSON-lines file."""

    def __init__(
        self,
        total: int,
        *,
        path: Path | None = None,
        desc: str = "train",
        initial: int = 0,
        show: bool = True,
    ) -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=sys.stderr,
            disable=not show,
            dynamic_ncols=True,
        )
        self._file: IO[str] | None = open(path, "w") if path else None  # noqa: SIM115
        self._path = path
        self._shown: dict[str, str] = {}  # the last step's figures
        self._val_loss: float | None = None  # the last evaluation's, shown until the next

    def advance_to(self, step: int) -> None:
        """Resuming at `step`: count the steps done before as done."""
        self._bar.update(max(0, step - self._bar.n))

    def __call__(self, record: StepRecord) -> None:
        if record.val_loss is not None:
            self._val_loss = record.val_loss
        if record.final_evaluation:  # not a step: the bar shows it and stays where it is
            self._bar.set_postfix({**self._shown, "val_loss": f"{self._val_loss:.4f}"})
        else:
            shown = {"loss": f"{record.loss:.4f}", "samples_s": f"{record.samples_per_second:.1f}"}
            if record.tokens:
                shown["tokens_s"] = f"{record.tokens_per_second:.0f}"
            if record.grad_norm is not None:
                shown["grad_norm"] = f"{record.grad_norm:.3g}"
            self._shown = shown
            if self._val_loss is not None:
                shown = {**shown, "val_loss": f"{self._val_loss:.4f}"}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        if self._file:
            try:
                self._file.write(json.dumps(asdict(record)) + "\n")
                self._file.flush()
            except OSError as e:  # a full disk: the log ends, not the training (and its model)
                log.error("the step log %s ended at step %d: %s", self._path, record.step, e)
                file, self._file = self._file, None
                with contextlib.suppress(OSError):
                    file.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.close()
        if self._file:
            with contextlib.suppress(OSError):  # its last flush, on a full disk: said above
                self._file.close()


def duration_text(seconds: float) -> str:
    """`1h02m03s`, `2m03s`, `3s`: how long a job took or has waited, for people."""
    minutes, secs = divmod(max(round(seconds), 0), 60)
    hours, mins = divmod(minutes, 60)
    if hours:
        return f"{hours}h{mins:02d}m{secs:02d}s"
    return f"{mins}m{secs:02d}s" if mins else f"{secs}s"
