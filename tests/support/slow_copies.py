"""A stand-in for a slow device behind `swarm.device.host_copies.HostCopies`: its copy to
the host takes as long as a test says (a wait on a gate the test opens, at most `seconds`), as a
busy GPU's would while it finishes the work queued before the copy."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

__all__ = ["SlowCopies"]


class SlowCopies:
    """Each `to_host` blocks its caller until `gate` is set or `seconds` pass; `started` is set
    when one begins. `opened` counts the copies the gate let through (False ones timed out: no
    one could open the gate while the copy held the thread that would)."""

    def __init__(self, seconds: float = 0.5, gated: bool = False) -> None:
        self.seconds, self.gated = seconds, gated
        self.started, self.gate = threading.Event(), threading.Event()
        self.copies: list[bool] = []  # per copy: whether the gate opened (else it timed out)
        self.threads: list[str] = []  # the thread each copy ran on

    def to_host(self, t: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
        return self._to_host(t)

    @contextmanager
    def _to_host(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if self.gated:
            self.copies.append(self.gate.wait(self.seconds))
        else:
            time.sleep(self.seconds)
            self.copies.append(True)
        yield t.cpu()

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device)
