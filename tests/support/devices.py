"""A machine's devices as `swarm.device.facts.DeviceFacts` says them, made up: GPUs of any model,
architecture and free memory, a torch build with any kernels, for the device checks' unit tests
on a CPU-only machine."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FakeFacts", "Gpu"]

GiB = 1 << 30


@dataclass
class Gpu:
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    free: int = 79 * GiB
    total: int = 80 * GiB


@dataclass
class FakeFacts:
    gpus: list[Gpu] = field(default_factory=list)
    cuda: str | None = "13.0"  # None: a CPU-only torch build
    arches: list[str] = field(default_factory=lambda: ["sm_80", "sm_90", "sm_100", "sm_120"])
    host: int | None = 100 * GiB
    mps: bool = False  # an Apple GPU torch sees (macOS)
    selected: list[int] = field(default_factory=list)  # what `select` was asked

    def torch_version(self) -> str:
        return "2.11.0+cu130" if self.cuda else "2.11.0+cpu"

    def cuda_build(self) -> str | None:
        return self.cuda

    def cuda_available(self) -> bool:
        return self.cuda is not None and bool(self.gpus)

    def mps_available(self) -> bool:
        return self.mps

    def device_count(self) -> int:
        return len(self.gpus)

    def name(self, index: int) -> str:
        return self.gpus[index].name

    def capability(self, index: int) -> tuple[int, int]:
        return self.gpus[index].capability

    def arch_list(self) -> list[str]:
        return list(self.arches) if self.cuda else []

    def free_total(self, index: int) -> tuple[int, int]:
        return self.gpus[index].free, self.gpus[index].total

    def host_free(self) -> int | None:
        return self.host

    def select(self, index: int) -> None:
        self.selected.append(index)
