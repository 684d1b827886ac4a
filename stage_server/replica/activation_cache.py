"""The activations a replica keeps between a microbatch's Forward and its Backward: its leaf input
and its output with the graph, which holds every tensor the backward will need.

Bounded two ways, both by dropping the oldest (whose Backward then recomputes from its inputs,
as one that reached another replica does): by count, the job's `activation_cache` within the
peer's `--max-activation-cache`; and by bytes, the peer's `--max-activation-cache-bytes`, since
a count says nothing of a graph's size (64 microbatches of a large stage fill a GPU). A
microbatch's bytes are those its graph saved, counted as the forward saves them (a
`saved_tensors_hooks` that sees each saved tensor, storages counted once), plus its input and
output; the stage's parameters are not counted (they are held anyway), their bf16 casts under
autocast are: made once per step (`swarm.model.cast_once`), the hooks count them in every
microbatch that saved them (an upper bound), the allocator in the one that made them.

On CUDA no Python runs per saved tensor (a stage call saves hundreds; a hook each is host time
the GPU waits for): the footprint is what the forward left allocated on the device, the CUDA
allocator's count after it less before it (saved tensors, casts and output, each storage once,
as the hooks count them), plus its input. Another thread allocating on the device meanwhile (a
delayed update's averaging) moves the figure by what it holds at the end: the bound is then
approximate, never a correctness matter (an eviction costs a recomputation).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator

import torch

from swarm.ops.rated import RatedLog

__all__ = ["ActivationCache", "DeviceFootprint", "Footprint", "measured_on_device"]

log = logging.getLogger(__name__)
_rated = RatedLog(log, every_s=60.0)

Key = tuple[int, int]  # (step, index)
Entry = tuple[torch.Tensor, torch.Tensor]  # (leaf input, output with its graph)
Saved = tuple[torch.Tensor, int]  # a tensor the graph saved, detached, and its version then


class Footprint:
    """The bytes of the distinct storages a forward saved for its backward (`counting`)."""

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}  # data pointer -> bytes

    def add_input(self, t: torch.Tensor) -> None:
        self.add(t)

    def add_output(self, t: torch.Tensor) -> None:
        self.add(t)

    def add(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return  # the stage's own (or a view of it: `w.t()`), held whether or not cached
        storage = t.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())


class DeviceFootprint:
    """The bytes a forward on a CUDA device left allocated (`counting`), with its input's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.memory_allocated(device)
        self._left = 0
        self._input = 0

    def close(self) -> None:
        self._left = max(0, torch.cuda.memory_allocated(self.device) - self._start)

    def add_input(self, t: torch.Tensor) -> None:
        self._input = t.untyped_storage().nbytes()  # allocated before: not in the difference

    def add_output(self, t: torch.Tensor) -> None:
        """Allocated by the forward: counted already."""

    @property
    def nbytes(self) -> int:
        return self._left + self._input


def measured_on_device(device: torch.device) -> bool:
    """Whether a forward on `device` is counted by its allocator (CUDA) rather than by hooks
    on each saved tensor (elsewhere: no allocator statistics to read)."""
    return device.type == "cuda"


class ActivationCache:
    """`(step, index)` -> `(leaf input, output)`, oldest first, within its bounds (`keep`)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, tuple[Entry, int]] = OrderedDict()
        self.bytes = 0  # the kept microbatches' footprints, summed
        self.evictions = 0  # microbatches dropped to the bounds: each costs its Backward a forward
        self._seen = (0, 0)  # (bytes, microbatches) of every footprint measured: their mean

    @contextlib.contextmanager
    def counting(self, device: torch.device | None = None) -> Iterator[Footprint | DeviceFootprint]:
        """Count what the forward run inside (on `device`) saves for its backward."""
        if device is not None and measured_on_device(device):
            measured = DeviceFootprint(device)
            try:
                yield measured
            finally:
                measured.close()
            return
        footprint = Footprint()

        def pack(t: torch.Tensor) -> Saved:
            footprint.add(t)
            # Detached: the same storage and version counter, nothing copied, but no grad_fn.
            # A tensor saved by the node that made it (tanh's, softmax's output) would otherwise
            # hold that node, which holds it: a cycle inside autograd's graph that gc cannot see,
            # freed only by a Backward, so every microbatch dropped unanswered would leak.
            return t.detach(), t._version

        def unpack(saved: Saved) -> torch.Tensor:
            t, version = saved
            if t._version != version:  # autograd checks this itself only without hooks
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                    f"{t._version}; expected version {version} instead"
                )
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield footprint

    def keep(
        self,
        key: Key,
        x: torch.Tensor,
        out: torch.Tensor,
        footprint: Footprint | DeviceFootprint,
        count: int,
        max_bytes: int,
    ) -> None:
        """Keep `key`'s activations, then drop the oldest past `count` or `max_bytes`."""
        footprint.add_input(x)
        footprint.add_output(out)
        nbytes = footprint.nbytes
        self._seen = (self._seen[0] + nbytes, self._seen[1] + 1)
        self.pop(key)
        self._entries[key] = ((x, out), nbytes)
        self.bytes += nbytes
        while self._entries and (len(self._entries) > count or self.bytes > max_bytes):
            self.pop(next(iter(self._entries)))  # the oldest; its Backward will recompute
            self.evictions += 1
        if nbytes > max_bytes:
            _rated.warning(
                "one-above-bound",
                "one microbatch's activations take %d bytes, above --max-activation-cache-bytes "
                "%d: none is kept, and every Backward recomputes its forward (raise the flag to "
                "keep them)",
                nbytes,
                max_bytes,
            )

    @property
    def footprint(self) -> int:
        """The mean bytes of a microbatch's activations, over every one kept so far (0: none
        yet): what sizes the microbatches the bounds hold (the first of a step, which makes the
        step's bf16 casts on CUDA, counts them; the mean spreads them over the others)."""
        total, count = self._seen
        return total // count if count else 0

    def pop(self, key: Key, default: None = None) -> Entry | None:
        """`key`'s activations, no longer kept (None if they are not)."""
        held = self._entries.pop(key, None)
        if held is None:
            return default
        self.bytes -= held[1]
        return held[0]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __delitem__(self, key: Key) -> None:
        if self.pop(key) is None:
            raise KeyError(key)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
