"""The handover site of this process (`swarm.device.handover`): two processes with the same site can
hand tensors over through memory instead of sending their bytes. Not an address (two homes'
192.168.1.10 are two machines) nor the host id a stage server announces (containers cloned from
one image share a machine id, and `SWARM_HOST_ID` may name several machines one domain): the
kernel's boot id, this process's IPC and network namespaces, the device of `/dev/shm` and the
user, so the same site means the same running kernel, the same shared memory, and segments this
user may open. The network namespace because one is a host of its own wherever the project
simulates several machines on one (its tests, `bench/wan.py`): servers there must go on the
(shaped, relayed) wire they are meant to. A CUDA device adds its UUID: the CUDA handover is
between processes on one device.

`SWARM_HANDOVER=off` gives no site: every hop then goes on the wire (a bench compares the two).
Off Linux (no boot id, no namespaces) there is none either."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

__all__ = ["BOOT_ID", "SHM_DIR", "site"]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
SHM_DIR = Path("/dev/shm")


def site(device: torch.device | str = "cpu") -> str:
    """This process's handover site for tensors on `device` ("": none, never matched)."""
    if os.environ.get("SWARM_HANDOVER", "").strip().lower() in ("off", "0", "false", "no"):
        return ""
    host = _host()
    device = torch.device(device)
    if not host or device.type not in ("cpu", "cuda"):
        return ""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{host}/cuda-{torch.cuda.get_device_properties(index).uuid}"
    return host


@functools.cache
def _host() -> str:
    try:
        boot = BOOT_ID.read_text().strip()
        ipc = os.readlink("/proc/self/ns/ipc")  # "ipc:[4026531839]"
        net = os.readlink("/proc/self/ns/net")
        shm = SHM_DIR.stat().st_dev
    except OSError:
        return ""
    return f"{boot}/{ipc}/{net}/shm-{shm}/uid-{os.getuid()}"
