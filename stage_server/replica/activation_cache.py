"""The activations a replica keeps between a microbatch's Forward and its Backward: its leaf input
and its output with the graph, which holds every tensor the backward will need.

Bounded two ways, both by dropping the oldest (whose Backward then recomputes from its inputs, as
one that reached another replica does): by count, the job's `activation_cache` within the peer's
`--max-activation-cache`; and by bytes, the peer's `--max-activation-cache-bytes` (on a device,
this server's part of it, within its free memory read again as each entry is kept:
`swarm.device.sharing`), since a count says nothing of a graph's size (64 microbatches of a large
stage fill a GPU). A microbatch's bytes are those its graph saved, counted as the forward saves
them (a `saved_tensors_hooks` that sees each saved tensor, storages counted once), plus its input
and output; the stage's parameters are not counted (they are held anyway), their bf16 casts under
autocast are: made once per step (`swarm.model.cast_once`), the hooks count them in every
microbatch that saved them (an upper bound), the allocator in the one that made them.

On CUDA the allocator counts it instead (`swarm.device.activation_bytes`).

Kept by whose Forward made them as well as by microbatch: any token holder may call a stage's
Forward, and one that named another's `(step, index)` replaced the activations that caller's
Backward then differentiated (a wrong gradient in the step, and an audit of it banning the
honest replica). Each caller's Backward finds its own Forward's only (`holder`), and recomputes
what it does not find.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator

import torch

from swarm.device.activation_bytes import DeviceFootprint, Footprint, measured_on_device
from swarm.device.sharing import DeviceMemory, Window
from swarm.ops import timeline
from swarm.ops.rated import RatedLog

__all__ = ["ActivationCache"]

log = logging.getLogger(__name__)
_rated = RatedLog(log, every_s=60.0)

Key = tuple[int, int, str]  # (step, index, holder: whose Forward made them)
Entry = tuple[torch.Tensor, torch.Tensor]  # (leaf input, output with its graph)
Saved = tuple[torch.Tensor, int]  # a tensor the graph saved, detached, and its version then


class ActivationCache:
    """`(step, index, holder)` -> `(leaf input, output)`, oldest first, within its bounds
    (`keep`)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Key, tuple[Entry, int]] = OrderedDict()
        self.bytes = 0  # the kept microbatches' footprints, summed
        self.evictions = 0  # microbatches dropped to the bounds: each costs its Backward a forward
        self._seen = (0, 0)  # (bytes, microbatches) of every footprint measured: their mean

    @contextlib.contextmanager
    def counting(
        self, device: torch.device | None = None, memory: DeviceMemory | None = None
    ) -> Iterator[Footprint | DeviceFootprint]:
        """Count what the forward run inside (on `device`, whose allocator `memory` asks)
        saves for its backward."""
        if device is not None and measured_on_device(device, memory):
            measured = DeviceFootprint(device, memory)
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
        window: Window,
    ) -> None:
        """Keep `key`'s activations, then drop the oldest past `count` or the bytes `window`
        allows now (on a device: its part of the device, within the free memory read again)."""
        footprint.add_input(x)
        footprint.add_output(out)
        nbytes = footprint.nbytes
        self._seen = (self._seen[0] + nbytes, self._seen[1] + 1)
        self.pop(key)
        self._entries[key] = ((x, out), nbytes)
        self.bytes += nbytes
        max_bytes = window.limit(self.bytes, nbytes)
        held, evicted = self.bytes, []
        while self._entries and (len(self._entries) > count or self.bytes > max_bytes):
            oldest = next(iter(self._entries))
            evicted.append([*oldest, "count" if len(self._entries) > count else "bytes"])
            self.pop(oldest)  # the oldest; its Backward will recompute
            self.evictions += 1
        window.publish(self.bytes)
        if timeline.enabled():  # what it kept against which bound, what that dropped (benches)
            timeline.mark(
                "keep",
                at=list(key),
                nbytes=nbytes,
                held=held,
                bound=max_bytes,
                share=window.bytes,  # the bound before the device's free memory had a say
                entries=len(self._entries),
                evicted=evicted,
            )
        if nbytes > max_bytes:
            _rated.warning(
                "one-above-bound",
                "one microbatch's activations take %d bytes, above the %d its window allows "
                "(--max-activation-cache-bytes %d, or this server's part of its device's free "
                "memory): none is kept, and every Backward recomputes its forward",
                nbytes,
                max_bytes,
                window.bytes,
            )

    @property
    def footprint(self) -> int:
        """The mean bytes of a microbatch's activations, over every one kept so far (0: none
        yet): what sizes the microbatches the bounds hold (the first of a step, which makes the
        step's bf16 casts on CUDA, counts them; the mean spreads them over the others)."""
        total, count = self._seen
        return total // count if count else 0

    def take(self, key: Key) -> Entry | None:
        """`key`'s activations for its Backward, no longer kept; None where they are not here
        (evicted, or another replica did the forward): that Backward recomputes the forward,
        which the benches' timeline marks."""
        entry = self.pop(key)
        if entry is None:
            timeline.mark("recompute", at=list(key))
        return entry

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
