"""Where bytecode may not be written beside the sources, the suite's interpreters keep it in the
user's cache (`tests.support.bytecode`): a fresh interpreter started after `keep` writes a
module's bytecode there and none in the tree, and reads it there the next time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import bytecode


def test_a_fresh_interpreter_keeps_its_bytecode_in_the_cache_not_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "cache"
    tree.mkdir()
    (tree / "kept.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(bytecode, "PYCACHE", cache)
    monkeypatch.setattr(sys, "pycache_prefix", sys.pycache_prefix)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    bytecode.keep()
    assert sys.pycache_prefix == str(cache) and not sys.dont_write_bytecode
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    ask = "import kept, sys; print(kept.__cached__, sys.flags.dont_write_bytecode)"
    written = []
    for _ in range(2):  # the first compiles and writes it, the second reads it
        done = subprocess.run(
            [sys.executable, "-c", ask], cwd=tree, capture_output=True, text=True, check=True
        )
        cached = Path(done.stdout.split()[0])
        assert cached.is_relative_to(cache) and cached.exists(), done.stdout
        assert done.stdout.split()[1] == "0"
        written.append(cached.stat().st_mtime_ns)
    assert written[0] == written[1]  # read, not compiled again
    assert not (tree / "__pycache__").exists()


def test_where_bytecode_may_be_written_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    bytecode.keep()
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in os.environ
