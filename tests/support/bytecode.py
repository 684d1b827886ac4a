"""The suite's bytecode, where none may be written beside the sources.

Where `PYTHONDONTWRITEBYTECODE` is set (as on this project's machines), every interpreter a test
run starts compiled each project and test module it imports from source: the xdist workers as
they collect the whole suite (10 s of CPU each that way, 4 s with bytecode), and each fresh
interpreter a test starts (a `swarm` command, a bench script, a pytest of its own, the device
check's parts and their stage servers). `keep` puts their bytecode in this user's cache instead
(`PYCACHE`, through `sys.pycache_prefix` and `PYTHONPYCACHEPREFIX`): the first to import a module
compiles it, the others read it, and the tree stays as clean as the flag asks. Each file is
checked against its source (modification time and size) as in `__pycache__`, and written
atomically (interpreters that compile a module at once each replace the file whole). The forked
swarm processes (`tests.support.forked`) keep theirs there too."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["PYCACHE", "keep"]

PYCACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm-tests-pycache"
"""In this user's own cache: a shared /tmp would let another user plant bytecode."""


def keep() -> None:
    """Bytecode read from and written to `PYCACHE`, by this process from now on and by every
    interpreter it starts, where the environment asks that none be written beside the sources.
    Nothing changes where bytecode may be written there (it already is)."""
    if not (sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return
    sys.pycache_prefix = str(PYCACHE)
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
