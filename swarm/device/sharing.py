"""The activation cache's byte bound sized by the device a stage server computes on.

A GPU host's activations live in device memory, and how many microbatches a replica can keep
between their forward and backward (so a Backward need not recompute) is what keeps its device
busy: a fixed 4 GiB is a sliver of an 80 GiB card and too much for an 8 GiB one. So on CUDA,
with `--max-activation-cache-bytes` left at its default, the bound is a share (`CACHE_SHARE`)
of the device memory free when the job is served: after the stage's weights, gradient sums and
optimizer state are there, and after whatever other servers on the card hold (each co-located
server started after the one before, as docs/deployment.md says, takes a share of what is left,
so the shares never add up past the card). An operator's own `--max-activation-cache-bytes`
is kept as given. A CPU peer's bound is the flag's, as ever: host memory is shared with
everything else on the machine.

What the bound holds, in microbatches (`microbatches_held`), is what the replica's load reports
say (`LoadReport.activation_capacity`), and trainers size their window by it
(`swarm.policy.window`): where the bound was sized for this peer (`sized`: by its device's free
memory, or by its operator's flag). A CPU peer at the default says nothing: its 4 GiB is no
measure of its host, and its trainers keep the window of old.

`DeviceMemory` is the seam (`TorchDeviceMemory` asks torch); the tests give a fake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is imported where a device is asked: the peer's limits import this
    import torch

__all__ = [
    "CACHE_SHARE",
    "DEFAULT_CACHE_BYTES",
    "DeviceMemory",
    "TorchDeviceMemory",
    "cache_bytes",
    "microbatches_held",
    "sized",
]

CACHE_SHARE = 0.5  # of the free device memory: the rest for the compute's own temporaries
DEFAULT_CACHE_BYTES = 4 << 30  # `--max-activation-cache-bytes`'s default (`PeerLimits`)
_DEFAULT = DEFAULT_CACHE_BYTES


class DeviceMemory(Protocol):
    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) bytes of `device`'s memory; None where the device cannot say (the
        CPU, whose memory is the host's)."""
        ...


class TorchDeviceMemory:
    def free_and_total(self, device: torch.device) -> tuple[int, int] | None:
        if device.type != "cuda":
            return None
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)


def cache_bytes(
    flag: int,
    device: torch.device,
    memory: DeviceMemory | None = None,
    share: float = CACHE_SHARE,
) -> int:
    """The activation cache's byte bound on `device`: `flag` (`--max-activation-cache-bytes`)
    when it was set or the device cannot say its free memory; else `share` of that memory."""
    if flag != _DEFAULT:
        return flag  # the operator's own bound
    known = (memory or TorchDeviceMemory()).free_and_total(device)
    if known is None:
        return flag
    free, _ = known
    return max(1, int(free * share))


def sized(flag: int, device: torch.device, memory: DeviceMemory | None = None) -> bool:
    """Whether `cache_bytes` sizes the bound for this peer: by its operator (`flag` set) or by
    `device`'s free memory; not a CPU peer's default, which measures nothing of its host."""
    return flag != _DEFAULT or (memory or TorchDeviceMemory()).free_and_total(device) is not None


def microbatches_held(count: int, max_bytes: int, footprint: int) -> int:
    """Microbatches whose activations a cache bounded by `count` and `max_bytes` keeps, each of
    `footprint` bytes: 0 before one was measured (`footprint` 0); at least 1, the one being
    computed, whose activations are held while it runs whether kept or not."""
    if footprint <= 0:
        return 0
    return max(1, min(count, max_bytes // footprint))
