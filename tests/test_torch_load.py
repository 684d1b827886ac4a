"""`torch.load` unpickles: a model file from anywhere else (an export downloaded from the
scheduler, a checkpoint on a shared disk) could run code on load unless it is read with
`weights_only=True`. Every `torch.load` the product makes (and every one the docs tell people to
run) says so, whatever the installed torch's default (M9-load).

Tests are left out: they load only files they wrote themselves a moment before."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.attack("M9-load")

ROOT = Path(__file__).resolve().parent.parent
_SKIPPED = {"tests", ".venv", ".git", "build", "dist"}


def _sources(suffix: str) -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob(f"*{suffix}"))
        if not _SKIPPED.intersection(p.relative_to(ROOT).parts[:1])
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]


def _is_torch_load(node: ast.AST) -> bool:
    """`torch.load`, or a bare `load` imported from torch (see `_loads_from_torch`)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "load"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def _weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def unsafe_loads(source: str) -> list[int]:
    """Lines of `source` where torch's load is called, or handed to a call (`to_thread`,
    `partial`), without `weights_only=True` on that call; or used any other way."""
    tree = ast.parse(source)
    aliases = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "torch"
        for a in node.names
        if a.name == "load"
    }

    def is_load(node: ast.AST) -> bool:
        return _is_torch_load(node) or (isinstance(node, ast.Name) and node.id in aliases)

    checked: set[int] = set()  # ids of the load expressions seen inside a call
    bad: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        handed = [a for a in node.args if is_load(a)]
        if is_load(node.func) or handed:
            checked.update(id(n) for n in [node.func, *handed])
            if not _weights_only(node):
                bad.append(node.lineno)
    for node in ast.walk(tree):
        stored = isinstance(getattr(node, "ctx", None), ast.Store)
        if is_load(node) and id(node) not in checked and not stored:
            bad.append(getattr(node, "lineno", 0))
    return sorted(set(bad))


def test_the_scan_finds_what_it_must() -> None:
    assert unsafe_loads("import torch\ntorch.load(p)\n") == [2]
    assert unsafe_loads("import torch\ntorch.load(p, weights_only=False)\n") == [2]
    assert unsafe_loads("import torch\nasyncio.to_thread(torch.load, p)\n") == [2]
    assert unsafe_loads("from torch import load as l\nl(p)\n") == [2]
    assert unsafe_loads("import torch\nf = torch.load\n") == [2]
    assert unsafe_loads("import torch\ntorch.load(p, weights_only=True)\n") == []
    assert unsafe_loads("import torch\nasyncio.to_thread(torch.load, p, weights_only=True)\n") == []
    assert unsafe_loads("import json\njson.load(f)\n") == []


def test_every_torch_load_is_weights_only() -> None:
    found = {
        str(p.relative_to(ROOT)): lines
        for p in _sources(".py")
        if "load" in (text := p.read_text(encoding="utf-8")) and (lines := unsafe_loads(text))
    }
    assert not found, f"torch.load without weights_only=True (file: lines): {found}"


def test_every_torch_load_in_the_docs_is_weights_only() -> None:
    call = re.compile(r"torch\.load\(([^()]*(\([^()]*\))?[^()]*)\)")
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in _sources(".md")
        for m in call.finditer(p.read_text(encoding="utf-8"))
        if "weights_only=True" not in m.group(1)
    ]
    assert not found, "torch.load without weights_only=True in the docs: " + "; ".join(found)
