"""The activation window's byte bound, sized by the device a stage server computes on together
with the other servers on it.

A GPU host's activations live in device memory, and how many microbatches a replica can keep
between their forward and backward (so a Backward need not recompute) is what keeps its device
busy: a fixed 4 GiB is a sliver of an 80 GiB card and too much for an 8 GiB one. So on a device
that says its free memory, with `--max-activation-cache-bytes` left at its default, the windows
of all the servers on it share `CACHE_SHARE` of the memory they may use: what is free now plus
what their windows hold (they would give it back), split evenly between the live claimants on
the device (`swarm.device.claims`: a registry on the host, keyed by the device's identity, from
which a killed server drops out by itself). Four servers on one 80 GiB card each get an eighth of
it, not half each; one that stops gives its part back to the others. A server that keeps nothing
between calls (the last stage: its ForwardBackward is one call) claims no part (`keeps`), so the
three stages before it that keep a step's activations get a sixth each.

Checked before every entry is kept (`DeviceWindow.limit`): the device's free memory is read again,
with the others' claims, and the cache drops its oldest microbatches (the new one too, if need
be) until it is within its part and the device keeps room for one more forward like the last.
Another process's allocation, weights loaded after the bound was first sized, or a claimant
come since: each shrinks the window at the next entry, never an out-of-memory error.

An operator's own `--max-activation-cache-bytes` is kept as the bound (`by_hand`), still never
past the device's free memory; such a server claims no part, and the others see its windows only
as memory in use. A CPU peer's bound is the flag's, as ever: host memory is shared with
everything else on the machine (`FixedWindow`).

What the bound holds, in microbatches (`microbatches_held`), is what the replica's load reports
say (`LoadReport.activation_capacity`), and trainers size their window by it
(`swarm.policy.window`): where the bound was sized for this peer (`sized`: by its device's memory,
or by its operator's flag). A CPU peer at the default says nothing: its 4 GiB is no measure of
its host, and its trainers keep the window of old.

`DeviceMemory` is the seam: `TorchDeviceMemory` asks torch, `swarm.device.standin` is the CPU
stand-in the tests run the same logic on.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Protocol

from swarm.device.claims import Claim, Claims

if TYPE_CHECKING:  # torch is imported where a device is asked: the peer's limits import this
    import torch

__all__ = [
    "CACHE_SHARE",
    "DEFAULT_CACHE_BYTES",
    "DeviceMemory",
    "DeviceWindow",
    "FixedWindow",
    "TorchDeviceMemory",
    "Window",
    "microbatches_held",
    "window_for",
]

log = logging.getLogger(__name__)

CACHE_SHARE = 0.5  # of the memory the windows may use: the rest for the compute's temporaries
DEFAULT_CACHE_BYTES = 4 << 30  # `--max-activation-cache-bytes`'s default (`PeerLimits`)


class DeviceMemory(Protocol):
    """What a device says of its memory (`TorchDeviceMemory`; `swarm.device.standin` on a CPU)."""

    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) bytes of `device`'s memory, free counting what this process's allocator
        holds unused; None where the device cannot say (the CPU, whose memory is the host's)."""
        ...

    def identity(self, device: torch.device) -> str:
        """`device`'s name on this host, the same in every process (a GPU's UUID)."""
        ...

    def allocated(self, device: torch.device) -> int | None:
        """The bytes tensors hold on `device` by its allocator's count; None where it keeps none
        (then a forward's footprint is counted by hooks: `swarm.device.activation_bytes`)."""
        ...


class TorchDeviceMemory:
    """`DeviceMemory` of the installed torch: CUDA says; the CPU and MPS do not."""

    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        if device.type != "cuda":
            return None
        from swarm.device.facts import TorchFacts

        return TorchFacts().free_total(device.index or 0)

    def identity(self, device: torch.device) -> str:
        import torch

        if device.type != "cuda":
            return f"{device.type}-{os.uname().nodename}"
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return f"cuda-{uuid}"
        # An older torch: the index among the GPUs this process was let see, as it was let.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
        return f"cuda-{visible}-{device.index or 0}"

    def allocated(self, device: torch.device) -> int | None:
        if device.type != "cuda":
            return None
        import torch

        return int(torch.cuda.memory_allocated(device))


class Window(Protocol):
    """The byte bound of one replica's activation window (`window_for`)."""

    sized: bool  # sized for this peer: by its device's memory or its operator (load reports)

    @property
    def bytes(self) -> int:
        """The bound now (on a device, sized again as asked): what the load reports'
        capacity is counted from."""
        ...

    def limit(self, held: int, reserve: int) -> int:
        """The bytes the window may hold now that it holds `held` (the newest entry counted),
        keeping room for `reserve` more (one forward like the last)."""
        ...

    def publish(self, held: int) -> None:
        """Say to the device's other servers that the window holds `held` bytes now."""
        ...

    def close(self) -> None:
        """Give the window's part of the device back (the replica is no longer served)."""
        ...


class FixedWindow:
    """A bound the device has no say in: a CPU's (the flag's, as ever)."""

    def __init__(self, nbytes: int = DEFAULT_CACHE_BYTES, *, sized: bool = False) -> None:
        self._bytes, self.sized = nbytes, sized

    @property
    def bytes(self) -> int:
        return self._bytes

    def limit(self, held: int, reserve: int) -> int:
        return self._bytes

    def publish(self, held: int) -> None:
        pass

    def close(self) -> None:
        pass


class DeviceWindow:
    """A bound on a device that says its free memory: this server's part of `share` of what the
    windows on the device may use (`claim`), or `by_hand` (the operator's), within the device's
    free memory, read again each time it is asked."""

    sized = True

    def __init__(
        self,
        device: torch.device,
        memory: DeviceMemory,
        claim: Claim | None,
        *,
        by_hand: int | None = None,
        share: float = CACHE_SHARE,
    ) -> None:
        self.device, self.memory, self.share = device, memory, share
        self._claim, self._by_hand = claim, by_hand
        self._held = 0  # what the window holds, as last published

    @property
    def bytes(self) -> int:
        """The bound now: the device's free memory and the others' claims read again."""
        return self._bound(self._held, self._free())

    def limit(self, held: int, reserve: int) -> int:
        free = self._free()
        self.publish(held)
        # The device keeps room for one more forward: what the window holds past that goes
        # (the window's bytes are on the device already: dropping them frees as much).
        room = held + free - reserve
        return max(0, min(self._bound(held, free), room))

    def _free(self) -> int:
        known = self.memory.free_and_total(self.device)
        return known[0] if known is not None else 0

    def _bound(self, held: int, free: int) -> int:
        """The operator's bound, or an even part of `share` of the device memory the windows on
        it may use: what is free, and what they hold (they would give it back)."""
        if self._by_hand is not None:
            return self._by_hand
        if self._claim is None:
            return max(1, int((free + held) * self.share))
        others = self._claim.others()
        usable = free + held + sum(others)
        return max(1, int(usable * self.share) // (len(others) + 1))

    def publish(self, held: int) -> None:
        self._held = held
        if self._claim is not None:
            self._claim.publish(held)

    def close(self) -> None:
        if self._claim is not None:
            self._claim.close()
            self._claim = None


def window_for(
    flag: int,
    device: torch.device,
    memory: DeviceMemory | None = None,
    claims: Claims | None = None,
    share: float = CACHE_SHARE,
    *,
    keeps: bool = True,
) -> Window:
    """The activation window's bound on `device` for a server whose `--max-activation-cache-bytes`
    is `flag`: shared with the device's other servers where the device says its memory and the
    flag was left alone; the flag within the device's free memory where it was set, or where
    the server `keeps` nothing between calls (the last stage, whose ForwardBackward is one call:
    its claim would take a part of the share from the stages that keep a step's activations);
    the flag as given where the device cannot say (a CPU)."""
    memory = memory or TorchDeviceMemory()
    by_hand = flag != DEFAULT_CACHE_BYTES
    if memory.free_and_total(device) is None:
        return FixedWindow(flag, sized=by_hand)
    if by_hand or not keeps:
        return DeviceWindow(device, memory, None, by_hand=flag, share=share)
    claim = _claim(claims or Claims(), memory.identity(device))
    return DeviceWindow(device, memory, claim, share=share)


def _claim(claims: Claims, device: str) -> Claim | None:
    try:
        return claims.claim(device)
    except OSError as e:  # no registry: this server sizes its window as if alone on the device
        log.warning(
            "device %s: no claim in %s (%s): its activation window is sized as if no other "
            "server shared the device (set --max-activation-cache-bytes by hand)",
            device,
            claims.root,
            e,
        )
        return None


def microbatches_held(count: int, max_bytes: int, footprint: int) -> int:
    """Microbatches whose activations a cache bounded by `count` and `max_bytes` keeps, each of
    `footprint` bytes: 0 before one was measured (`footprint` 0); at least 1, the one being
    computed, whose activations are held while it runs whether kept or not."""
    if footprint <= 0:
        return 0
    return max(1, min(count, max_bytes // footprint))
