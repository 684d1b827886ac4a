"""The layering of DESIGN.md, read from the source with `ast` (imports inside functions too):
`swarm/` imports no role; a role imports `swarm/`, the pure policies and itself; the few edges
between roles that remain are listed in `ALLOWED`, and each of them must still exist."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import ROOT

SHARED = "swarm"
ROLES = ("stage_server", "scheduler", "client")
SKIP = ("swarm.proto",)  # generated code

POLICIES = frozenset(
    {
        "swarm.policy.wiring",
        "swarm.policy.placement",
        "swarm.policy.placement_search",
        "swarm.policy.rebalance",
        "swarm.policy.stage_pool",
    }
)
"""The pure policies (no I/O): any role may import them; they import `swarm`, each other, stdlib
and third-party packages only. A policy split into more modules lists each of them here."""

SIM = "scheduler.sim"
"""The simulator: `swarm`, the pure policies and itself."""

ALLOWED: dict[tuple[str, str], str] = {
    # (importer, imported): why this edge between roles exists. Each must still exist.
    ("client.standalone", "scheduler.coordinator"): (
        "the standalone trainer runs the step coordinator in-process"
    ),
    ("scheduler.service", "client.trainer"): "the scheduler's embedded trainer",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.where})"


def within(name: str, prefixes: Iterable[str]) -> bool:
    """`name` is one of `prefixes` or inside one of them (a submodule)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _pure() -> frozenset[str]:
    """The policies and the packages above them (importing a policy runs their `__init__`)."""
    parents = {p.rsplit(".", i)[0] for p in POLICIES for i in range(1, p.count(".") + 1)}
    return POLICIES | parents


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` may import module `imported` (both dotted names)."""
    pure = _pure()
    if not within(imported, ROLES):
        return True  # `swarm`, stdlib, third-party
    if within(importer, (SHARED,)):
        return False
    if importer in pure:
        return imported in pure
    if within(importer, (SIM,)):
        return imported in pure or within(imported, (SIM,))
    if imported in pure or _top(importer) == _top(imported):
        return True
    return any(within(importer, (a,)) and within(imported, (b,)) for a, b in ALLOWED)


def imports_of(
    module: str, source: str, *, package: bool, known: set[str], path: str
) -> Iterator[Edge]:
    """Every module `module` imports, anywhere in its source; `from X import Y` names `X.Y` when
    that is a known module, else `X`. Relative imports are resolved."""
    base = module if package else module.rpartition(".")[0]
    nodes = [n for n in ast.walk(ast.parse(source, path)) if isinstance(n, ast.stmt)]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, f"{path}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parent = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{parent}.{node.module}" if node.module else parent
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield Edge(module, sub if sub in known else target, f"{path}:{node.lineno}")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for top in (SHARED, *ROLES):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if not within(name, SKIP):
                modules[name] = path
    return modules


def edges(root: Path = ROOT) -> list[Edge]:
    modules = project_modules(root)
    known = set(modules)
    found: list[Edge] = []
    for name, path in modules.items():
        found += imports_of(
            name,
            path.read_text(),
            package=path.name == "__init__.py",
            known=known,
            path=str(path.relative_to(root)),
        )
    return found


def forbidden(found: Iterable[Edge]) -> list[str]:
    return sorted({str(e) for e in found if not allowed(e.importer, e.imported)})


def stale(found: Iterable[Edge]) -> list[str]:
    """Allowed edges no module uses any more: the table must not allow more than is needed."""
    used = [(e.importer, e.imported) for e in found]
    return [
        f"{a} -> {b}"
        for a, b in ALLOWED
        if not any(within(i, (a,)) and within(m, (b,)) for i, m in used)
    ]


def test_no_forbidden_imports() -> None:
    bad = forbidden(edges())
    if bad:
        pytest.fail("imports that break the layering (DESIGN.md, Layout):\n" + "\n".join(bad))


def test_allowed_edges_are_still_needed() -> None:
    unused = stale(edges())
    if unused:
        pytest.fail("ALLOWED edges no module uses any more; remove them:\n" + "\n".join(unused))


def test_every_policy_and_the_simulator_exist() -> None:
    modules = project_modules()
    missing = [m for m in (*POLICIES, SIM) if m not in modules]
    assert not missing, f"POLICIES/SIM name modules that do not exist: {missing}"


def _edges_of(module: str, source: str, package: bool = False) -> list[Edge]:
    known = {"scheduler.wiring", "scheduler.store", "client.trainer", "stage_server.runtime"}
    return list(imports_of(module, source, package=package, known=known, path="x.py"))


def test_the_checker_itself() -> None:
    source = (
        "import os\n"
        "from scheduler import wiring\n"
        "def late():\n"
        "    from client.trainer import PipelineTrainer\n"
        "    import scheduler.store\n"
        "from . import runtime\n"
    )
    found = _edges_of("stage_server.fake", source)
    assert [e.imported for e in found] == [
        "os",
        "swarm.policy.wiring",
        "client.trainer",
        "scheduler.store",
        "stage_server.runtime",
    ]
    assert forbidden(found) == [
        "stage_server.fake -> client.trainer (x.py:4)",
        "stage_server.fake -> scheduler.store (x.py:5)",
    ]
    # `swarm` imports no role, not even a pure policy; a policy imports no other role module.
    assert forbidden(_edges_of("swarm.fake", "from swarm.policy.wiring import Wiring\n"))
    assert forbidden(_edges_of("swarm.policy.wiring", "from scheduler.store import JobStore\n"))
    assert not forbidden(_edges_of("swarm.policy.wiring", "from swarm.rpc.lease import Replica\n"))
    # The simulator: policies and itself, not the service shell.
    assert not forbidden(_edges_of("scheduler.sim.x", "from scheduler.sim.model import A\n"))
    assert forbidden(_edges_of("scheduler.sim.x", "from scheduler.store import JobStore\n"))
    # Allowed edges hold only from their own importer; relative imports in a package resolve.
    assert not forbidden(_edges_of("scheduler.service", "from client.trainer import T\n"))
    assert forbidden(_edges_of("scheduler.job_api", "from client.trainer import T\n"))
    assert _edges_of("client", "from .trainer import T\n", package=True)[0].imported == (
        "client.trainer"
    )
    assert stale([]) == [f"{a} -> {b}" for a, b in ALLOWED]


def test_the_job_commands_start_without_torch() -> None:
    # `swarm submit/status/list/cancel` are what a user types again and again (and what the
    # integration tests poll): importing torch would cost each of them seconds of CPU.
    code = "import sys, client.commands; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.strip() == "False", result.stderr
