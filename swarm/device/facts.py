"""The device a process computes on: `--device` checked against what this machine has (a clear
error listing its devices), the torch build checked for kernels of this GPU's architecture, the
process's current CUDA device set to it (so nothing lands on cuda:0 unasked), the job's float32
matmul precision (TF32 only when the job says), and the device memory a process used at most.

Why a seam (`DeviceFacts`): the checks are what a volunteer meets first on a GPU host (a CPU-only
torch, a GPU index that does not exist, an RTX 50-series card under a torch built before it), and
they must be testable on a CPU-only machine: the tests hand in fake facts, the processes
`TorchFacts`. `swarm doctor` and a stage server's start run the same checks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import torch

from swarm.errors import SwarmError

__all__ = [
    "INSTALL_FIX",
    "DeviceFacts",
    "TorchFacts",
    "apply_matmul_precision",
    "describe_devices",
    "evictions_line",
    "find_device",
    "free_memory",
    "host_available",
    "missing_kernels",
    "peak_line",
    "peak_memory",
    "read_evictions",
    "read_peak",
    "resolve_device",
    "use_device",
]

INSTALL_FIX = "install a CUDA build of torch (README, 'Installing on a GPU host')"


class DeviceFacts(Protocol):
    """What torch and the machine say about the devices (`TorchFacts` asks torch)."""

    def torch_version(self) -> str: ...
    def cuda_build(self) -> str | None: ...  # torch.version.cuda; None: a CPU-only build
    def cuda_available(self) -> bool: ...
    def mps_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def name(self, index: int) -> str: ...
    def capability(self, index: int) -> tuple[int, int]: ...
    def arch_list(self) -> list[str]: ...  # the build's kernels: sm_XY (binary), compute_XY (PTX)
    def free_total(self, index: int) -> tuple[int, int]: ...  # bytes free, bytes in all
    def host_free(self) -> int | None: ...  # MemAvailable (bytes); None where unknown
    def select(self, index: int) -> None: ...  # make cuda:index the current CUDA device


class TorchFacts:
    """`DeviceFacts` from the installed torch."""

    def torch_version(self) -> str:
        return str(torch.__version__)

    def cuda_build(self) -> str | None:
        return torch.version.cuda  # type: ignore[no-any-return]

    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def mps_available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def capability(self, index: int) -> tuple[int, int]:
        major, minor = torch.cuda.get_device_capability(index)
        return major, minor

    def arch_list(self) -> list[str]:
        return list(torch.cuda.get_arch_list())

    def free_total(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        # What torch's caching allocator holds but no tensor uses (a stage released, say) is
        # free to this process, though not to the driver, which mem_get_info asks.
        if torch.cuda.is_initialized():
            free += torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(free), int(total)

    def host_free(self) -> int | None:
        return host_available()

    def select(self, index: int) -> None:
        torch.cuda.set_device(index)


def describe_devices(facts: DeviceFacts) -> str:
    """This machine's devices as `--device` names them: "cpu, cuda:0 (NVIDIA H100), ..."."""
    names = ["cpu"]
    if facts.cuda_available():
        names += [f"cuda:{i} ({facts.name(i)})" for i in range(facts.device_count())]
    if facts.mps_available():
        names.append("mps")
    return ", ".join(names)


def pick_device(facts: DeviceFacts) -> str:
    """The `--device` this machine serves best on (`--device auto`, the doctor's default): the
    GPU with the most free memory that the torch build runs on, else an Apple GPU, else the
    CPU. An invite's next step then fits whoever runs it, a CPU-only friend too (issue 68)."""
    if facts.cuda_available():
        usable = [i for i in range(facts.device_count()) if missing_kernels(facts, i) is None]
        if usable:
            return f"cuda:{max(usable, key=lambda i: (facts.free_total(i)[0], -i))}"
    return "mps" if facts.mps_available() else "cpu"


def resolve_device(spec: str, facts: DeviceFacts) -> torch.device:
    """The device `--device spec` names, with its index (`cuda` is `cuda:0`), once this machine
    has it (`find_device`) and the torch build has kernels for it (`missing_kernels`); else a
    `SwarmError` that says what to do."""
    device = find_device(spec, facts)
    problem = missing_kernels(facts, device.index) if device.type == "cuda" else None
    if problem:
        raise SwarmError(f"--device {spec}: {problem}")
    return device


def find_device(spec: str, facts: DeviceFacts) -> torch.device:
    """The device `--device spec` names, with its index, once this machine has it; else a
    `SwarmError` that lists the devices there are and says what to do."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise SwarmError(
            f"--device {spec!r} is not a device torch knows (cpu, cuda:N, mps); "
            f"this machine has: {describe_devices(facts)}"
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        if not facts.mps_available():
            raise SwarmError(
                f"--device {spec}: MPS is not available on this machine; "
                f"it has: {describe_devices(facts)}"
            )
        return device
    if device.type != "cuda":
        raise SwarmError(
            f"--device {spec}: swarm computes on cpu, cuda:N or mps; "
            f"this machine has: {describe_devices(facts)}"
        )
    if not facts.cuda_available():
        build = facts.cuda_build()
        why = (
            f"torch {facts.torch_version()} is a CPU-only build: {INSTALL_FIX}"
            if build is None
            else f"torch {facts.torch_version()} (CUDA {build}) sees no GPU: check the NVIDIA "
            "driver (nvidia-smi lists the GPUs) and CUDA_VISIBLE_DEVICES"
        )
        raise SwarmError(
            f"--device {spec}: CUDA is not available ({why}); "
            f"this machine has: {describe_devices(facts)}"
        )
    index = 0 if device.index is None else device.index
    count = facts.device_count()
    if index >= count:
        raise SwarmError(
            f"--device {spec}: no such GPU; this machine has {count} "
            f"(--device {describe_devices(facts)})"
        )
    return torch.device("cuda", index)


def _arch_number(arch: str) -> int | None:
    """sm_90 -> 90, sm_90a -> 90, compute_120 -> 120; None for what is not an architecture."""
    found = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", arch)
    return int(found[1]) if found else None


def missing_kernels(facts: DeviceFacts, index: int | None) -> str | None:
    """Why the torch build cannot run on GPU `index` (None when it can): it needs a binary for
    the GPU's major architecture at or below its minor version (binaries run on later minors of
    a major), or PTX for an architecture at or below it (the driver compiles it). An RTX 50-series
    card (sm_120) under a torch built for sm_90 at most is the usual case: "no kernel image is
    available for execution on the device" at the first kernel."""
    index = index or 0
    major, minor = facts.capability(index)
    have = facts.arch_list()
    for arch in have:
        n = _arch_number(arch)
        if n is None:
            continue
        if arch.startswith("sm_") and n // 10 == major and n % 10 <= minor:
            return None
        if arch.startswith("compute_") and n <= major * 10 + minor:
            return None
    build = facts.cuda_build()
    return (
        f"torch {facts.torch_version()} (CUDA {build}) has no kernels for {facts.name(index)} "
        f"(sm_{major}{minor}); it was built for {', '.join(have) or 'no GPU'}. Install a torch "
        "build for this GPU (sm_120, the RTX 50 series: torch >= 2.7 built for CUDA >= 12.8, e.g. "
        "`make install TORCH_INDEX=https://download.pytorch.org/whl/cu128`)"
    )


def use_device(device: torch.device, facts: DeviceFacts) -> None:
    """Make `device` this process's current CUDA device: what torch places on "cuda" without an
    index (a context, pinned host buffers, a synchronize) goes there, not to cuda:0."""
    if device.type == "cuda":
        facts.select(device.index or 0)


def apply_matmul_precision(tf32: bool, device: torch.device | str) -> None:
    """`training.tf32`: float32 matmuls on TF32 tensor cores (about 10 mantissa
    bits: faster, no longer exact against a float32 reference) or IEEE float32 (the default).
    Process-wide in torch, so it is set where a stage or the reference is built; on a CPU it
    changes nothing."""
    if torch.device(device).type != "cuda":
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the legacy flag warns there
        # Touched only to change it: a process that never asks for TF32 keeps torch's default
        # (IEEE float32 for matmuls) and never mixes the two APIs, which torch refuses to read.
        if tf32 or matmul.fp32_precision == "tf32":
            matmul.fp32_precision = "tf32" if tf32 else "ieee"
    elif matmul.allow_tf32 != tf32:
        matmul.allow_tf32 = tf32


def free_memory(device: torch.device, facts: DeviceFacts) -> tuple[int | None, str]:
    """The bytes `device` has free for a stage now, and where that figure comes from: a GPU's
    free memory (`torch.cuda.mem_get_info`, with what this process's allocator holds unused),
    the host's available memory for the CPU (and MPS, which shares it); None when unknown."""
    if device.type == "cuda":
        return facts.free_total(device.index or 0)[0], "free (torch.cuda.mem_get_info)"
    return facts.host_free(), "available (MemAvailable)"


def peak_memory(device: torch.device) -> str | None:
    """The device memory this process allocated at most ("device cuda:0: at most 1234567890 B
    allocated (max_memory_allocated), 2345678901 B reserved"), or None off CUDA: a line a stage
    server logs as it stops, which the benchmarks read."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    allocated = torch.cuda.max_memory_allocated(device)
    return peak_line(device, allocated, torch.cuda.max_memory_reserved(device))


def peak_line(device: torch.device | str, allocated: int, reserved: int) -> str:
    """`peak_memory`'s line, which `read_peak` reads back."""
    return (
        f"device {device}: at most {allocated} B allocated (max_memory_allocated), "
        f"{reserved} B reserved"
    )


_PEAK = re.compile(r"device \S+: at most (\d+) B allocated \(max_memory_allocated\)")


def read_peak(log: str) -> int | None:
    """The bytes the last `peak_memory` line in a process's log says it allocated at most."""
    found = _PEAK.findall(log)
    return int(found[-1]) if found else None


def evictions_line(evictions: int) -> str:
    """The line a stage server logs as it stops, which `read_evictions` reads back."""
    return f"the activation cache evicted {evictions} microbatches (their Backward recomputed)"


_EVICTIONS = re.compile(r"the activation cache evicted (\d+) microbatches")


def read_evictions(log: str) -> int | None:
    """The evictions the last `evictions_line` in a process's log counts (None: none logged)."""
    found = _EVICTIONS.findall(log)
    return int(found[-1]) if found else None


def host_available() -> int | None:
    """The host memory the kernel would give without swapping (MemAvailable, bytes); None off
    Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
