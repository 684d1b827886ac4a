"""A device out of memory, named: which job, stage and computation, how large a microbatch, and
how much device memory was free (`torch.cuda.mem_get_info` on CUDA; "cpu" where there is no
device to ask), in place of torch's bare "CUDA out of memory". An allocation failing in host
memory counts too (torch's CPU allocator, MemoryError): a CPU peer's memory is its device's.

`OutOfDeviceMemory` is a `ResourceExhausted`: a trainer's hop takes it as a refusal that took
nothing (the replica's receipts are honest about it, `stage_server.replica.step_sums`) and replays
the microbatch on another replica; a commit that answers it is left out of the retry of its round
(`scheduler.coordinator.commit`), its microbatches replayed on the others. `inject` raises the
error a `SWARM_FAULTS` raising point (`swarm.ops.faults`) asks for, as torch would raise it.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from swarm.errors import ResourceExhausted
from swarm.ops.faults import Point, due

__all__ = [
    "OutOfDeviceMemory",
    "free_memory",
    "inject",
    "is_out_of_memory",
    "named",
    "oom_message",
    "out_of_memory",
]

_MIB = 1 << 20
# What a failed allocation's RuntimeError says (lower case): CUDA's and other backends', torch's
# CPU allocator's on Linux and macOS ("can't allocate memory: you tried to allocate N bytes")
# and on Windows ("not enough memory: you tried to allocate N bytes").
_ALLOCATION_FAILED = ("out of memory", "can't allocate memory", "not enough memory")


class OutOfDeviceMemory(ResourceExhausted):
    """A computation ran out of device memory here; the message names where and how much was
    free. Nothing of it was kept: the work is replayed (elsewhere, or after a smaller retry)."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed, on the device or the host: torch's own
    class, the bare RuntimeError older builds and other backends raise, torch's CPU allocator's
    (a RuntimeError: "DefaultCPUAllocator: can't allocate memory"), Python's MemoryError, or
    an OSError of ENOMEM. A CPU peer's memory is its device's; a GPU peer's host memory (its
    staging, its spill) runs out as its device's would: either way the work fits elsewhere."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if (oom is not None and isinstance(error, oom)) or isinstance(error, MemoryError):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and any(
        says in str(error).lower() for says in _ALLOCATION_FAILED
    )


def free_memory(device: torch.device) -> str:
    """Free device memory, for a log line: "812 MiB free of 80 GiB on cuda:0", or "cpu"."""
    if device.type != "cuda":
        return device.type
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception as e:  # a device that cannot say (it may be what failed)
        return f"free memory on {device} unknown ({type(e).__name__})"
    return f"{free // _MIB} MiB free of {total // _MIB} MiB on {device}"


@contextmanager
def named(
    job: str,
    stage: int,
    what: str,
    device: torch.device,
    *,
    samples: int | None = None,
    nbytes: int | None = None,
) -> Iterator[None]:
    """Run the body; an out-of-memory error in it becomes `OutOfDeviceMemory` naming the job,
    the stage, the computation (`what`), its size (a microbatch's `samples`, or a buffer's
    `nbytes`) and the free memory."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e) or isinstance(e, OutOfDeviceMemory):
            raise
        raise OutOfDeviceMemory(oom_message(job, stage, what, device, e, samples, nbytes)) from e


def oom_message(
    job: str,
    stage: int,
    what: str,
    device: torch.device,
    error: BaseException,
    samples: int | None = None,
    nbytes: int | None = None,
) -> str:
    """What `OutOfDeviceMemory` says (`named`)."""
    size = (
        f" of a microbatch of {samples} samples"
        if samples is not None
        else f" of {nbytes / _MIB:.1f} MiB"
        if nbytes is not None
        else ""
    )
    return (
        f"job {job} stage {stage}: out of device memory in {what}{size} "
        f"({free_memory(device)}): {error}"
    )


def out_of_memory(message: str) -> RuntimeError:
    """The error torch raises when an allocation fails (`torch.OutOfMemoryError` where this
    torch has it, else a RuntimeError saying so)."""
    oom = getattr(torch, "OutOfMemoryError", None)
    try:
        return oom(message) if oom is not None else RuntimeError(message)  # type: ignore[no-any-return]
    except TypeError:  # a class that cannot be made from Python
        return RuntimeError(message)


def inject(point: Point, step: int, peer: str = "") -> None:
    """Raise an out-of-memory error here if a `SWARM_FAULTS` raising point says so (once; for
    `peer`'s faults, `swarm.ops.faults.due`)."""
    if due(point, step, peer):
        raise out_of_memory(f"CUDA out of memory (injected: SWARM_FAULTS {point}@{step})")
