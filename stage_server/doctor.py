"""`swarm doctor`: the preflight a volunteer runs before lending a machine. Each check says what it
found, and a failed one says what to do: torch sees the device; the torch build has kernels for
this GPU's architecture; free device and host memory hold the largest stage of a job (`--job`);
the broker takes this peer's login, the scheduler the swarm token, and the path others take to
this machine (direct, or behind NAT through a relay), each host's name looked up first, as
its own check with its own fix (`stage_server.peer.name_check`) (`--broker`, `--scheduler`,
or all from an invite: `--join FILE`; `stage_server.peer.network_checks`). A stage server runs
the device checks at its start (`preflight`), so a machine that cannot serve says so before it
joins.

The device facts come through `swarm.device.facts.DeviceFacts`, so the checks run on a CPU-only
machine in the tests with fakes; the network checks log in and call for real (a test starts what
they dial).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import torch

from stage_server.peer.name_check import Resolver, SystemResolver, host_of, name_check
from stage_server.peer.network_checks import (
    Check,
    broker_login,
    local_host,
    path_check,
    scheduler_call,
)
from swarm.device.facts import (
    INSTALL_FIX,
    DeviceFacts,
    TorchFacts,
    find_device,
    missing_kernels,
    pick_device,
    resolve_device,
    use_device,
)
from swarm.errors import SwarmError
from swarm.flags import add_flag, add_token, token
from swarm.net.invite import add_join_flag
from swarm.net.tls import add_tls_flags

__all__ = ["Check", "add_arguments", "diagnose", "preflight", "run", "stage_bytes"]

GiB = 1 << 30
AUTO = "auto"  # `--device auto`: the doctor picks (`pick_device`) and says which


def preflight(spec: str, facts: DeviceFacts | None = None) -> torch.device:
    """A stage server's start: `--device spec` exists here and the torch build runs on it (else a
    `SwarmError` naming the fix, before anything is built), and it becomes this process's current
    CUDA device, so that nothing lands on cuda:0 unasked."""
    facts = facts or TorchFacts()
    device = resolve_device(spec, facts)
    use_device(device, facts)
    return device


def stage_bytes(job_path: Path) -> tuple[int, int, int]:
    """`(stage, parameters, bytes)` of the largest stage of the job at `job_path`: weights,
    gradient sums and the optimizer's moments (AdamW two, SGD with momentum one), in the job's
    dtype. A floor: activations and averaging buffers come on top."""
    from swarm.job.config import load_job  # here: `swarm doctor` without --job reads no job
    from swarm.model.transformer import DTYPES, stage_layout

    job = load_job(job_path)
    sizes = [
        sum(p.numel() for p in stage_layout(job, k).parameters())
        for k in range(job.training.stages)
    ]
    stage = max(range(len(sizes)), key=sizes.__getitem__)
    opt = job.optimizer
    moments = 2 if opt.kind == "adamw" else 1 if opt.momentum else 0
    width = torch.empty((), dtype=DTYPES[job.training.dtype]).element_size()
    return stage, sizes[stage], sizes[stage] * width * (2 + moments)


def _device_checks(spec: str, facts: DeviceFacts) -> tuple[list[Check], torch.device | None]:
    picked = spec == AUTO
    spec = pick_device(facts) if picked else spec
    build = facts.cuda_build()
    torch_found = f"torch {facts.torch_version()}, " + (
        f"built for CUDA {build}" if build else "a CPU-only build"
    )
    checks = [Check("torch", True, torch_found)]
    try:
        device = find_device(spec, facts)
    except SwarmError as e:
        wants_gpu = spec.startswith("cuda")
        fix = (
            INSTALL_FIX
            if wants_gpu and build is None
            else "pass a --device this machine has (listed above)"
        )
        return [*checks, Check("device", False, str(e), fix)], None
    how = f" (picked: serve with --device {spec})" if picked else ""
    if device.type != "cuda":
        return [*checks, Check("device", True, f"{device}{how}")], device
    index = device.index or 0
    major, minor = facts.capability(index)
    name = f"{device}: {facts.name(index)} (sm_{major}{minor}){how}"
    checks.append(Check("device", True, name))
    problem = missing_kernels(facts, index)
    if problem:
        head, _, fix = problem.partition(". Install")
        checks.append(Check("kernels", False, head, f"install{fix}"))
        return checks, None
    checks.append(Check("kernels", True, f"the build has kernels for sm_{major}{minor}"))
    return checks, device


def _memory_checks(job: Path, device: torch.device, facts: DeviceFacts) -> list[Check]:
    stage, params, need = stage_bytes(job)
    what = f"the largest stage of {job.name} (stage {stage}, {params / 1e6:.1f}M parameters) "
    what += f"needs at least {need / GiB:.2f} GiB"
    checks = []
    if device.type == "cuda":
        free, total = facts.free_total(device.index or 0)
        ok = free >= need
        found = f"{what} on {device}; {free / GiB:.2f} GiB of {total / GiB:.2f} GiB free"
        fix = "free the GPU (nvidia-smi lists what holds it), or choose another --device"
        checks.append(Check("device memory", ok, found, "" if ok else fix))
    host = facts.host_free()
    if host is not None:
        ok = host >= need  # a snapshot stages the state through the host, or a CPU holds it
        found = f"{what} of host memory; {host / GiB:.2f} GiB available"
        fix = "stop what holds the host's memory, or serve a smaller job's stages"
        checks.append(Check("host memory", ok, found, "" if ok else fix))
    return checks


def diagnose(
    spec: str,
    facts: DeviceFacts,
    job: Path | None = None,
    broker: str | None = None,
    scheduler: str | None = None,
    timeout: float = 5.0,
    *,
    token: str | None = None,
    peer: str = "",
    resolver: Resolver | None = None,
) -> list[Check]:
    """Every check `swarm doctor` makes, in order: the device's, then the network's, each made
    as the peer makes it (the hosts' names looked up through `resolver`, the system's by
    default; the broker's login, the scheduler's authenticated call, the path)."""
    checks, device = _device_checks(spec, facts)
    if job is not None and device is not None:
        checks += _memory_checks(job, device, facts)
    resolver = resolver or SystemResolver()
    network = _network_checks(broker, scheduler, timeout, token, peer, resolver)
    return checks + asyncio.run(network)


async def _network_checks(
    broker: str | None,
    scheduler: str | None,
    timeout: float,
    token: str | None,
    peer: str,
    resolver: Resolver,
) -> list[Check]:
    # Each host's name first: a call whose lookup ran out its deadline would blame its server.
    names: dict[str, Check] = {}
    for address in filter(None, (broker, scheduler)):
        target = host_of(address)
        if target is not None and target[0] not in names:
            names[target[0]] = await name_check(*target, resolver, timeout)
    checks, relays, seen = list(names.values()), None, ""

    def unnamed(address: str, what: str) -> Check | None:
        """`what`'s check when its host's name did not resolve: not asked, said so."""
        target = host_of(address)
        name = names.get(target[0]) if target is not None else None
        if name is None or name.ok:
            return None
        found = "not asked: its host's name did not resolve (see the name check)"
        return Check(what, False, found, name.fix)

    if broker:
        login = unnamed(broker, "broker")
        if login is None:
            login, relays = await broker_login(broker, peer, token, timeout)
        checks.append(login)
    if scheduler:
        call = unnamed(scheduler, "scheduler")
        if call is None:
            call, seen = await scheduler_call(scheduler, token, timeout)
        checks.append(call)
    if checks and all(c.ok for c in checks) and relays is not None and scheduler:
        checks.append(path_check(local_host(scheduler), seen, relays))
    return checks


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "device",
        AUTO,
        "the device a stage server would compute on: cpu, cuda:N, mps, or auto (the GPU with "
        "the most free memory that this torch runs on, else mps, else cpu; said in its check)",
    )
    p.add_argument("--job", type=Path, help="a job file: does its largest stage fit here?")
    add_flag(p, "broker", None, "the swarm's MQTT broker URL: does it take this peer's login?")
    add_flag(p, "scheduler", None, "the scheduler's host:port: does it take the swarm token?")
    add_flag(p, "peer", "", "the peer id to log in to the broker as (default: the token alone)")
    add_token(p)
    add_tls_flags(p)
    add_join_flag(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")


def run(command: str, args: argparse.Namespace) -> int:
    # The bus logs a refused login as it happens; here the check's line says it, with the fix.
    logging.getLogger("swarm.bus").setLevel(logging.CRITICAL)
    checks = diagnose(
        args.device,
        TorchFacts(),
        args.job,
        args.broker,
        args.scheduler,
        args.timeout,
        token=token(args),
        peer=args.peer,
    )
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if not c.ok]
    print(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    sys.stdout.flush()
    return 1 if failed else 0
