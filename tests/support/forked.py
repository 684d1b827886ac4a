"""Swarm processes for the tests, forked from a server that imported torch once.

A fresh interpreter spends about 6 s of CPU importing torch and `torch._dynamo` (which any
`torch.optim` optimizer imports) before it serves; the suite starts hundreds of stage servers,
schedulers and trainers on 2 cores, so that import was most of its time. A `multiprocessing`
fork server imports both once; each process forks from it and runs `swarm <args>` as
`python -m swarm.cli` would: its own pid, environment, log file and exit status (a SIGKILL reads
-9), killed and stopped as any process is. grpc is not imported before the fork (its core does not
survive one); every role starts its own. In a namespace of the lab (`swarm.local.netns`) the
child enters it first, in a session of its own, as `ip netns exec` put a fresh one there.

Where bytecode is not to be written (`PYTHONDONTWRITEBYTECODE`, as on this project's machines),
every forked process compiled each module torch's import had not brought, the project's and
grpc's, from source again: half of a stage server's start. Forked processes keep their bytecode
in a cache of their own outside the tree instead (`tests.support.bytecode.PYCACHE`,
`sys.pycache_prefix`), which the first to import a module fills and the others read; the tree
stays as clean as the flag asks. (The test process and every interpreter it starts keep theirs
there too: `tests.support.bytecode.keep`.)
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import BinaryIO

from swarm.local import netns
from swarm.local.procs import Child
from tests.support.bytecode import PYCACHE

PRELOAD = [
    "torch",
    "torch._dynamo",
    # What every role imports besides, that starts no thread at import and holds no socket (as
    # grpc's core would): another 0.05-0.1 s of CPU per process, imported once.
    "aiomqtt",
    "cryptography.x509",
    "google.protobuf.message",
    "prometheus_client",
    "yaml",
]
CLONE_NEWNET = 0x40000000  # <sched.h>
SESSION_S = 30.0  # a forked child is in its own session within this (a busy machine)
_context: ForkServerContext | None = None


def _forkserver() -> ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def context() -> ForkServerContext:
    """The fork server's `multiprocessing` context, for a test's own Python processes (a
    `Process` whose target is a function, not `swarm ARGS`): each forks from the server that
    imported torch once instead of importing it afresh, as the "spawn" context's do."""
    return _forkserver()


def server_pids() -> set[int]:
    """The fork server's pid and its resource tracker's, once started (they outlive each test)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        forkserver._forkserver._forkserver_pid,  # type: ignore[attr-defined]
        resource_tracker._resource_tracker._pid,  # type: ignore[attr-defined]
    }
    return {pid for pid in pids if pid is not None}


def _enter(ns: str, cwd: str) -> None:
    """In the forked child, before anything starts a thread: into network namespace `ns` (its
    threads, grpc's included, are made in it) and a session of its own, as `ip netns exec` in
    `start_new_session` put it; in `cwd`. (`ip netns exec` also mounts the namespace's /sys and
    /etc/netns files: swarm reads neither.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)
    os.setsid()
    os.chdir(cwd)


def _keep_bytecode() -> None:
    """In the forked child, before it imports the project: bytecode is read from and written to
    `PYCACHE` where none may be written beside the sources (written atomically: children that
    compile a module at once each replace the file whole)."""
    if sys.dont_write_bytecode:
        sys.pycache_prefix = str(PYCACHE)
        sys.dont_write_bytecode = False


def _run(args: list[str], log_path: str, env: dict[str, str], ns: str = "", cwd: str = "") -> None:
    """In the forked child: become `python -m swarm.cli ARGS`, writing to `log_path`; with `ns`,
    in that network namespace and in `cwd`."""
    if ns:
        _enter(ns, cwd)
    _keep_bytecode()
    out_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["swarm", *args]
    from swarm.cli import main

    code: object
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


class Forked:
    """A forked process with `subprocess.Popen`'s face (`swarm.local.procs.Child`)."""

    def __init__(
        self, args: list[str], out: BinaryIO, env: dict[str, str], ns: str = "", cwd: str = ""
    ) -> None:
        self.args = args
        self._process = _forkserver().Process(
            target=_run, args=(args, out.name, env, ns, cwd), daemon=True
        )
        self._process.start()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(["swarm", *self.args], timeout or 0.0)
        return code

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def launch(args: list[str], out: BinaryIO, env: dict[str, str]) -> Forked:
    """A `swarm.local.procs.Launcher`."""
    return Forked(args, out, env)


def launch_in(ns: str, argv: list[str], out: BinaryIO, env: dict[str, str], cwd: Path) -> Child:
    """A `swarm.local.netns.Launcher`: `python -m swarm.cli ARGS` (this interpreter's) forked
    into namespace `ns`; any other command as `ip netns exec` runs it."""
    if argv[:3] != [sys.executable, "-m", "swarm.cli"]:
        return netns.ip_netns_exec(ns, argv, out, env, cwd)
    child = Forked(argv[3:], out, env, ns, str(cwd))
    # Returned once in its own session, as `Popen(start_new_session=True)` returns (a caller
    # signals its group at once: `os.killpg`).
    deadline = time.monotonic() + SESSION_S
    while child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(child.pid) == child.pid:
                break
        if time.monotonic() > deadline:
            child.kill()
            raise TimeoutError(f"swarm {' '.join(argv[3:])} in {ns}: no session of its own")
        time.sleep(0.002)
    return child
