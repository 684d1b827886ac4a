"""The layering of docs/architecture.md ("Where each concept lives"), read from the source with
`ast` (imports inside functions too). Each rule is a plain function over import edges or over one
module's source, so that a seeded violation can prove it bites:

- `swarm/` imports no role; roles meet only over the `ALLOWED` edges, each still used;
- a role's subpackage imports only itself, its sibling subpackages and `swarm`
  (`KNOWN_SUBPACKAGE_IMPORTS` aside, each still used);
- no two-way tie: of two sibling subpackages, at most one imports the other;
- floors: a `swarm` module imports only its own package and lower `FLOORS`;
- purity: the policies and the simulator reach no I/O or heavy library, not even indirectly;
- confinement: the MQTT libraries only in `swarm.bus`; gRPC only where the wire is;
- one hop loop: only `swarm.rpc.hop` keeps the wiring's books;
- only the CLI dispatcher loads modules by name;
- only `swarm.job` reads the keys that choose the training rule (`KNOWN_RULE_READS` aside);
- trust has its rooms (`TRUST_ROOMS`: the trainer's audits, the coordinator's judges): a module
  named for trust lives in one, and the concept map names it; a room imports none of the planes
  it sits beside, and a module outside the rooms imports one only at a door (`TRUST_DOORS`, each
  still used);
- only `swarm.model` reads `boundary_rank` (`KNOWN_BOUNDARY_READS` aside, each still reading it);
- no import circle between project modules (`KNOWN_CIRCLES` aside, each still a circle);
- tests take shared helpers only from `tests/support/` (`HELPER_SOURCES` aside, each still used);
- a module keeps to `BUDGET` lines (`OVERSIZE` aside, each still over it), and no Python file
  but the generated ones turns the formatter off for a line (`FORMAT_OFF`): code is not squeezed;
- a function keeps under `LONG` lines (`LONG_FUNCTIONS` aside, each still that long): a prompt
  to ask whether it reads as one step does, never a count to squeeze code to;
- the concept map (docs/architecture.md) and README's layout name real paths, and the map names
  every module over `MAPPED` lines."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import pytest

from tests.support.cli import ROOT

SHARED = "swarm"
ROLES = ("stage_server", "scheduler", "client")
POLICY = "swarm.policy"
"""The pure policies (wiring, placement, rebalancing, backoff): every role uses them."""
SIM = "scheduler.sim"
"""The simulator: it drives the real policies, so it must stay as pure as they are."""
HOP = "swarm.rpc.hop"
"""The one hop loop: choose a replica, call it, keep the wiring's books."""
DISPATCHER = "swarm.cli"
"""The `swarm` command: it names role modules by string so that `swarm/` imports no role."""

ALLOWED: dict[tuple[str, str], str] = {
    # (importer, imported): why this edge between roles exists. Each must still exist.
    ("client.standalone", "scheduler.coordinator"): (
        "the standalone trainer runs the step coordinator in-process"
    ),
    ("scheduler.job_training", "client.trainer"): "one job's training runs the embedded trainer",
    ("scheduler.job_training", "client.metrics"): "and serves the embedded trainer's series",
}

KNOWN_SUBPACKAGE_IMPORTS: dict[tuple[str, str], str] = {
    # (subpackage, what it imports besides its siblings and swarm): why. Each must still be.
    ("client.data_plane", "client.metrics"): (
        "the data plane counts its hops and bytes in the trainer's series (`TrainerMetrics`), "
        "which the trainer serves and the scheduler's embedded trainer too (an ALLOWED edge)"
    ),
    ("client.audit", "client.metrics"): (
        "the audits count their re-executions and outcomes in the trainer's series too"
    ),
}
"""A role's subpackages (`stage_server.replica`, `stage_server.peer`, `scheduler.coordinator`,
`client.data_plane`, ...) hold its concepts; its top-level modules are its processes and their
orchestrators, which import the subpackages. A subpackage imports only itself, its siblings and
`swarm`, so a concept never reaches up into the process that runs it, and whatever two
subpackages share lives in one of them."""

FLOORS: tuple[tuple[str, ...], ...] = (
    # 0: leaves: errors, time (deadlines, helpers beside a wait), flags, the generated messages
    # and their generator.
    (
        "swarm.errors",
        "swarm.clock",
        "swarm.deadline",
        "swarm.alongside",
        "swarm.flags",
        "swarm.proto",
        "swarm.protogen",
    ),
    # 1: values and their encodings: addresses, token and TLS; job files; the wire's codecs.
    ("swarm.net", "swarm.job", "swarm.wire"),
    # 2: what decides and what watches: the pure policies; metrics, lifecycle, faults.
    ("swarm.policy", "swarm.ops"),
    # 3: the device a process computes on (its facts, kernels, copies, clocks, memory), above
    # the job (its kernel switches) and the faults it raises; the model computes on it.
    ("swarm.device",),
    # 4: the machinery: the model, MQTT, RPC, processes on one machine; the NAT relay (above the
    # addresses and tokens it carries, the backoff it pauses with and the rated log it refuses on).
    ("swarm.model", "swarm.bus", "swarm.rpc", "swarm.local", "swarm.relay"),
    # 5: the entry points.
    ("swarm.cli", "swarm.commands"),
)
"""`swarm`'s packages, low to high. Each imports only itself and lower floors, never a package on
its own floor, so each can be read and tested with only what lies below it. The roles sit above
floor 5; the package `swarm` itself (its version) sits below floor 0."""

IMPURE = ("torch", "numpy", "grpc", "grpc_health", "aiomqtt", "amqtt", "paho", "prometheus_client")
"""What the policies and the simulator never load: I/O, the wire, metrics, tensors. The simulator
runs thousands of peers' hours in seconds, and every role imports the policies."""
PURE_MAY_IMPORT = (*FLOORS[0], *FLOORS[1], POLICY)
"""Besides the standard library and themselves; what these reach is checked too (`IMPURE`)."""
PURE_EXTRAS: dict[tuple[str, str], str] = {
    # (importer, imported): why a pure module imports this. Each must still exist.
    ("scheduler.sim.cli", "matplotlib"): "the optional `--plot`, imported where it draws",
}
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}

MQTT = ("aiomqtt", "amqtt", "paho")
MQTT_HOME = "swarm.bus"
GRPC = ("grpc", "grpc_health", "grpc_tools")
"""gRPC's libraries; the generated `swarm.proto.*_pb2_grpc` stubs count as gRPC too."""
GRPC_SHARED: dict[str, str] = {
    "swarm.proto": "the generated stubs",
    "swarm.protogen": "regenerates them (grpc_tools, a dev dependency)",
    "swarm.rpc": "status mapping, the servicer wrapper, the stage client, the hop loop",
    "swarm.net": "the one dialer's secure channels, ports, the token's interceptors",
    "swarm.wire": "the wire's encodings and chunked streams",
}
GRPC_ROLES: dict[str, str] = {
    # Role modules that serve or dial. Each must still import gRPC.
    "stage_server.server": "serves StageService, PoolService and health",
    "stage_server.servicer": "the StageService servicer",
    "stage_server.agent": "sets the health status its server serves",
    "stage_server.aggregator.main": "serves PoolService and health (the aggregator peer)",
    "stage_server.aggregator.identity": "serves StageService.Info, the dial-back's call",
    "stage_server.averaging.butterfly": "dials PoolService.Reduce (the all-reduce's round)",
    "stage_server.averaging.service": "serves PoolService.Reduce (the owner's side)",
    "stage_server.averaging.channels": "the channels PoolService is dialled over",
    "scheduler.main": "serves the job API and health",
    "scheduler.job_api": "the job API's servicer",
    "scheduler.dial_back": "dials a peer back (StageService.Info) to measure its reachability",
    "stage_server.peer.network_checks": "`swarm doctor` calls the job API with the token",
    "client.sdk": "dials the job API",
    "client.remote": "dials the job API for leases",
}

BOOKKEEPING = frozenset({"started", "busy", "failed", "finished"})
"""The wiring's books on a replica's calls; kept in one loop, they cannot drift between copies."""
BOOK_KEEPERS: dict[str, str] = {
    HOP: "the one hop loop",
    POLICY: "the wiring defines them",
    SIM: "the simulator drives the policy directly",
}
WIRING = re.compile(r"pool|wiring", re.IGNORECASE)
"""A receiver named so is a wiring pool (`pool`, `self._pools[s]`, `wiring.pool(s)`): methods of
the same names elsewhere (`self.metrics.failed`, a backoff's `failed`) are other books."""

LOADERS = re.compile(r"import_module|__import__|module_from_spec|spec_from_\w+")
"""What loads a module named by a string (`find_spec` and `importlib.resources` load nothing)."""

RULE_HOME = "swarm.job"
RULE_KEYS: dict[str, frozenset[str]] = {
    "pool": frozenset({"mode", "overlap"}),
    "training": frozenset({"delayed_update"}),
}
"""The job's keys that choose the training rule, by section: only `RULE_HOME` reads them (into
`rule_of`'s `Rule`), every other module asks the rule. A read is one of these keys taken from
something named as its section: an attribute (`job.pool.mode`, `self.pool.overlap`, `pool.mode`,
`job.training.delayed_update`), a subscript with the key as a constant (`raw["pool"]["mode"]`),
`getattr(pool, "mode")` or `training.get("delayed_update")`. Comments and strings are no code;
a section under another name (`p = job.pool; p.mode`) escapes, which review catches."""
KNOWN_RULE_READS: dict[str, str] = {
    # module: why it still reads a rule key. Each must still read one (a stale entry fails).
}

TRUST_ROOMS: dict[str, tuple[str, ...]] = {
    # room: the modules it sits beside and never imports (a plane is wrapped, not threaded)
    "client.audit": ("client.data_plane",),
    "scheduler.coordinator.trust": (
        "scheduler.coordinator.coordinator",
        "scheduler.coordinator.commit",
        "scheduler.coordinator.rollback",
        "scheduler.coordinator.voids",
    ),
}
"""Trust's rooms (DESIGN.md, "Trust"; docs/architecture.md's map): the trainer's audits and the
coordinator's judges. Each is given what it acts through (a plane to wrap, a rollback and voids
to call) where it is made, so it imports none of the modules it sits beside."""
TRUST_NAMED = re.compile(
    r"audit|\bbans?\b|banned|disput|liar|verdict|judge|sum_check|sent_word|norm_bound|"
    r"round_check|contribution|standing"
)
"""A module of the trainer or the coordinator (`TRUST_HOMES`) named so is a trust concept: it
lives in a room."""
TRUST_HOMES = ("client", "scheduler.coordinator")
TRUST_DOORS: dict[str, str] = {
    # module outside the rooms that imports one: why. Each must still import one.
    "client.data_plane.plane": (
        "the composition point: `make_plane` wraps the carry plane in `Audited` and gives the "
        "push plane its `PushAudits`"
    ),
    "scheduler.coordinator.coordinator": (
        "builds the job's standing (the members filter) and its bans, given the rollback and "
        "the voids"
    ),
    "scheduler.coordinator.commit": (
        "asks `RoundChecks.passed` of each PREPARE's answers, and sends each member the "
        "checksums it is judged by"
    ),
    "scheduler.coordinator.rounds": (
        "a pool's round end (rounds between commits) checks its sums with the same judges, "
        "not yet through `RoundChecks`"
    ),
    "scheduler.coordinator.eager_rounds": "the checksums its background sum is sent with",
    "scheduler.coordinator.replicas": "the checksums a PREPARE carries on the wire",
    "scheduler.job_reports": "a `Ban` told to the job's history and `swarm status`",
    "scheduler.stored_bans": "the job store keeps each `Ban` across restarts",
}

BOUNDARY_HOME = "swarm.model"
BOUNDARY_KEY = "boundary_rank"
"""The key that chooses the subspace boundary: only `BOUNDARY_HOME` reads it (into
`boundary_of`'s `Boundary`, chosen once from the job as the rule is), every other module asks
the boundary. A read is the key taken from anything (the name is the key's alone): an attribute
(`job.model.boundary_rank`, `cfg.boundary_rank`), a subscript with it as a constant,
`getattr(x, "boundary_rank")` or `x.get("boundary_rank")`; comments and strings are no code."""
KNOWN_BOUNDARY_READS: dict[str, str] = {
    # module: why it reads the key outside the model. Each must still read it.
    "swarm.job.small_boundary": "the job's own check of its small-boundary keys, as it is read",
}

KNOWN_CIRCLES: dict[tuple[str, ...], str] = {
    # A circle's modules, sorted: why it is left for now. Each must still be exactly a circle.
}
"""Import circles between project modules (imports inside functions and under `TYPE_CHECKING`
count: they are the same knot, only loaded later). A circle is a strongly connected part of the
import graph; its modules load only in one order, and none can be read or tested alone."""

TESTS = "tests"
SUPPORT = "tests.support"
"""Where tests take shared helpers (fakes, harnesses, fixtures) from: a test file imports no other
test file, so each reads alone and a helper has one home. conftest files may be imported too."""
HELPER_SOURCES: dict[str, str] = {
    # A module under tests/, not tests/support/, that others import: why. Each must still be.
}

BUDGET = 450
"""The lines a module may have: one concept, one file (the generated messages are not counted)."""
GENERATED = re.compile(r"swarm\.proto\.\w+_pb2(?:_grpc)?")
OVERSIZE: dict[str, str] = {
    # module: why it may pass BUDGET (an orchestrator per role, a single large concept). Each
    # must still pass it (a stale entry fails). The budget is a prompt to ask "is this one
    # concept?", not a press: a module that is one is listed here rather than squeezed.
    "stage_server.agent": (
        "the orchestrator of a stage server under a scheduler: each state of the peer's life "
        "(announced, measured, assigned, moving, serving, released) is one step of one loop"
    ),
    "scheduler.coordinator.ledger": (
        "one step's book of its microbatches: what each still needs, who leased it and as which "
        "run, who holds it where, what was given back; every method reads and keeps the same "
        "few maps together, and its neighbours (free tasks, late receipts, voids) are modules"
    ),
    "scheduler.coordinator.membership": (
        "who counts as a replica of each stage: admitted by a copy, re-admitted, dropped; each "
        "rule reads the same few sets (members, those left, joiners, standbys), and its "
        "neighbours (discards, unlisted members, standbys, the entry rate) are modules already"
    ),
    "stage_server.servicer": (
        "the stage service itself: one handler per RPC, each decoded, routed and handed to its "
        "room (push plane, answering, commit, state transfer); split, the service would be too"
    ),
    "stage_server.aggregator.main": (
        "the aggregator process's orchestrator: its jobs followed, its pools served, announced"
    ),
    "stage_server.replica.commit": (
        "one replica's commit of a step: PREPARE (receipts checked, sums averaged, checksums, "
        "the audits it takes part in) and APPLY, read together as the step's one commit"
    ),
    "stage_server.averaging.butterfly": (
        "one concept, a butterfly round: sending each part, taking its sum back, and every way "
        "the round fails, which must be read together"
    ),
    "scheduler.coordinator.rounds": (
        "one concept, the coordinator's side of a pool's rounds: PREPARE and APPLY of a round's "
        "end, its members' failures and who is dropped, read together as the two phases are"
    ),
    "scheduler.coordinator.coordinator": (
        "the step coordinator's orchestrator: it builds its parts in the order each is given "
        "what it needs (the standing, the views it filters, the voids and the rollback, then "
        "the bans given both), and runs the step protocol over them"
    ),
    "scheduler.service": (
        "the scheduler's orchestrator: the registry fed from the bus, each job's task from its "
        "placing to its end, and a job's status put together from the store, the registry and "
        "its coordinator's view"
    ),
    "swarm.job.schema": (
        "one concept, the job file's sections and keys, each with its default and range and a "
        "comment saying what it means: the comments are the reference, not to be squeezed"
    ),
    "stage_server.replica.runtime": (
        "one concept, a stage replica's model state: its parameters, optimizer and step, and "
        "every way the step's update reaches them (applied, recorded for followers, kept for "
        "late audits), which must be read together as one step's commit"
    ),
    "swarm.rpc.stage_client": (
        "one concept, the client of StageService: one method per call of the service, each with "
        "its deadline, chunking and error conversion"
    ),
}
LONG = 80
"""The lines (its signature and docstring too) at which a function is asked "does it read as
the step does?": issue 66 found the hot path's new work threaded through a few functions that
had grown past it (16 of them), each doing several things of the step at once."""
LONG_FUNCTIONS: dict[str, str] = {
    # module:qualified name: why it may reach LONG. Each must still reach it (a stale entry
    # fails). Split by what the function does, never squeezed; or listed here with the reason.
}
FORMAT_OFF = re.compile(r"#\s*fmt:\s*(?:skip|off)\b")
"""A comment that keeps `ruff format` off a line or a block: squeezed code hides behind it. Only
the generated messages (`GENERATED`, which ruff does not format) may have one."""
FORMATTED_DIRS = ("swarm", "stage_server", "scheduler", "client", "tests", "bench", "examples")
MAPPED = 150
"""A module longer than this is a concept of its own: the concept map names it (its file, not
only its folder)."""

DOC_TABLES = (
    ("docs/architecture.md", "Where each concept lives", True),  # required: the concept map
    ("README.md", "Layout", False),
)
PATHLIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
FILELIKE = re.compile(r".*\.(?:py|pyi|proto|md|toml|ya?ml|json|txt|sh|cfg)")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # path:line


def within(name: str, prefixes: Iterable[str]) -> bool:
    """`name` is one of `prefixes` or inside one of them (a submodule)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _project(name: str) -> bool:
    return _top(name) in (SHARED, *ROLES)


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


@cache
def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of `swarm/` (generated code included: it imports too) and of the roles."""
    modules: dict[str, Path] = {}
    for top in (SHARED, *ROLES):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


@cache
def edges(root: Path = ROOT) -> tuple[Edge, ...]:
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
    return tuple(found)


@cache
def suite_edges(root: Path = ROOT) -> tuple[Edge, ...]:
    """Every import of every module under tests/."""
    paths = sorted((root / TESTS).rglob("*.py"))
    names = {
        path: ".".join(p for p in path.relative_to(root).with_suffix("").parts if p != "__init__")
        for path in paths
    }
    known = set(names.values()) | set(project_modules(root))
    found: list[Edge] = []
    for path, name in names.items():
        found += imports_of(
            name,
            path.read_text(),
            package=path.name == "__init__.py",
            known=known,
            path=str(path.relative_to(root)),
        )
    return tuple(found)


def sources(root: Path = ROOT) -> Iterator[tuple[str, str, str]]:
    """(module, source, path) of every project module."""
    for name, path in project_modules(root).items():
        yield name, path.read_text(), str(path.relative_to(root))


# Roles: `swarm` imports none; roles meet only over `ALLOWED`.


def allowed(importer: str, imported: str) -> bool:
    """Whether module `importer` may import module `imported` (both dotted names)."""
    if not within(imported, ROLES):
        return True  # `swarm`, stdlib, third-party
    if within(importer, (SHARED,)):
        return False
    if within(importer, (SIM,)):
        return within(imported, (SIM,))
    if _top(importer) == _top(imported):
        return True
    return any(within(importer, (a,)) and within(imported, (b,)) for a, b in ALLOWED)


def forbidden(found: Iterable[Edge]) -> list[str]:
    return sorted(
        f"{e.where}: {e.importer} imports {e.imported}: "
        + (
            "swarm imports no role"
            if within(e.importer, (SHARED,))
            else "roles meet only over ALLOWED"
        )
        for e in set(found)
        if not allowed(e.importer, e.imported)
    )


def stale(found: Iterable[Edge]) -> list[str]:
    """Table entries no module needs any more: a table must not allow more than is needed."""
    used = {(e.importer, e.imported) for e in found}

    def uses(importer: str, imported: str | Callable[[str], bool]) -> bool:
        def wanted(m: str) -> bool:
            return imported(m) if callable(imported) else within(m, (imported,))

        return any(within(i, (importer,)) and wanted(m) for i, m in used)

    return [
        *(f"ALLOWED {a} -> {b}" for a, b in ALLOWED if not uses(a, b)),
        *(f"GRPC_ROLES {a}" for a in GRPC_ROLES if not uses(a, _is_grpc)),
        *(f"PURE_EXTRAS {a} -> {b}" for a, b in PURE_EXTRAS if not uses(a, b)),
    ]


# A role's subpackages.


def role_packages(root: Path = ROOT) -> set[str]:
    """Every package (a folder with `__init__.py`) of the roles."""
    return {
        name
        for name, path in project_modules(root).items()
        if path.name == "__init__.py" and within(name, ROLES)
    }


def subpackage_of(name: str, packages: Iterable[str]) -> str | None:
    """The role subpackage (`role.x`, one of `packages`) that holds module `name`; None for a
    role's top-level module (the role's package itself included) and for what is no role's."""
    parts = name.split(".")
    home = ".".join(parts[:2])
    return home if len(parts) > 1 and within(name, ROLES) and home in set(packages) else None


def reaches_up(
    found: Iterable[Edge],
    packages: Iterable[str],
    known: Mapping[tuple[str, str], str] = KNOWN_SUBPACKAGE_IMPORTS,
) -> list[str]:
    """Imports by a role's subpackage of anything of the roles but its own role's subpackages
    (a top-level module of its role, or another role), unless `known` names the edge; and
    entries of `known` that no import needs any more."""
    packages = set(packages)
    bad: set[str] = set()
    used: set[tuple[str, str]] = set()
    for e in found:
        if subpackage_of(e.importer, packages) is None or not within(e.imported, ROLES):
            continue  # a top-level module; or `swarm`, the standard library, a third party
        same_role = _top(e.imported) == _top(e.importer)
        if same_role and subpackage_of(e.imported, packages) is not None:
            continue  # itself or a sibling
        entry = next(
            (k for k in known if within(e.importer, (k[0],)) and within(e.imported, (k[1],))),
            None,
        )
        if entry is not None:
            used.add(entry)
            continue
        what = "a top-level module of its role" if same_role else "another role"
        bad.add(
            f"{e.where}: {e.importer} imports {e.imported} ({what}): a role's subpackage imports "
            "only itself, its siblings and swarm"
        )
    return [
        *sorted(bad),
        *(
            f"KNOWN_SUBPACKAGE_IMPORTS {a} -> {b}: no longer imported; remove it"
            for a, b in known
            if (a, b) not in used
        ),
    ]


def sibling_ties(found: Iterable[Edge], packages: Iterable[str]) -> list[str]:
    """Pairs of a role's sibling subpackages that import each other (`peer` -> `replica` and
    `replica` -> `peer`), each with one import of each way. Two subpackages tied both ways are
    one concept cut in two: neither reads or tests without the other, and what they share
    belongs in the one the other imports."""
    packages = set(packages)
    first: dict[tuple[str, str], Edge] = {}
    for e in sorted(set(found), key=lambda e: (e.where, e.importer, e.imported)):
        here, there = subpackage_of(e.importer, packages), subpackage_of(e.imported, packages)
        if here is not None and there is not None and here != there:
            first.setdefault((here, there), e)
    return [
        f"{first[a, b].where}: {a} imports {b} ({first[a, b].importer} -> {first[a, b].imported}) "
        f"and {first[b, a].where}: {b} imports {a} ({first[b, a].importer} -> "
        f"{first[b, a].imported}): sibling subpackages are tied one way only; move what one "
        "needs of the other into the one it imports"
        for a, b in sorted(first)
        if a < b and (b, a) in first
    ]


# Floors.


def floor_of(name: str) -> tuple[str, int] | None:
    """The unit of `FLOORS` (package or leaf module) that holds `name`, and its floor."""
    if name == SHARED:
        return SHARED, -1
    for floor, units in enumerate(FLOORS):
        for unit in units:
            if within(name, (unit,)):
                return unit, floor
    return None


def unfloored(modules: Iterable[tuple[str, str]]) -> list[str]:
    """`swarm` modules (name, path) on no floor: a new package must say where it sits."""
    return [
        f"{path}:1: {name} is on no floor; name its floor in FLOORS"
        for name, path in modules
        if within(name, (SHARED,)) and floor_of(name) is None
    ]


def floor_violations(found: Iterable[Edge]) -> list[str]:
    bad = set()
    for e in found:
        if not within(e.importer, (SHARED,)) or not within(e.imported, (SHARED,)):
            continue
        here, there = floor_of(e.importer), floor_of(e.imported)
        if here is None:
            continue  # `unfloored` reports it
        if there is None:
            bad.add(f"{e.where}: {e.importer} imports {e.imported}, which is on no floor")
        elif there[0] != here[0] and there[1] >= here[1]:
            bad.add(
                f"{e.where}: {e.importer} (floor {here[1]}) imports {e.imported} (floor "
                f"{there[1]}): a swarm module imports only its own package and lower floors"
            )
    return sorted(bad)


# Purity.


def _graph(found: Iterable[Edge]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Project module -> the project modules importing it runs (parent packages included), and
    -> the third-party libraries it imports."""
    found = list(found)
    nodes = {e.importer for e in found}
    graph: dict[str, set[str]] = {n: set(_parents(n)) & nodes for n in nodes}
    libs: dict[str, set[str]] = {n: set() for n in nodes}
    for e in found:
        if not _project(e.imported):
            libs[e.importer].add(_top(e.imported))
        elif (target := _resolve(e.imported, nodes)) is not None:
            graph[e.importer] |= {target, *(set(_parents(target)) & nodes)}
    return graph, libs


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _resolve(name: str, nodes: set[str]) -> str | None:
    """The module `name` loads: `from X import f` names `X` and `X.f` is an attribute."""
    while name and name not in nodes:
        name = name.rpartition(".")[0]
    return name or None


def _impure_chain(start: str, graph: Mapping[str, set[str]], libs: Mapping[str, set[str]]) -> str:
    """The shortest import chain from `start` to an `IMPURE` library, or ""."""
    chains = {start: start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if hit := sorted(libs.get(node, set()) & set(IMPURE)):
            return f"{chains[node]} -> {hit[0]}"
        for after in sorted(graph.get(node, set()) - chains.keys()):
            chains[after] = f"{chains[node]} -> {after}"
            queue.append(after)
    return ""


def impure(found: Iterable[Edge]) -> list[str]:
    found = list(found)
    graph, libs = _graph(found)
    nodes = set(graph)
    bad = set()
    for e in found:
        pure = next((p for p in (POLICY, SIM) if within(e.importer, (p,))), None)
        if pure is None or within(e.imported, (POLICY, pure)) or _top(e.imported) in STDLIB:
            continue
        extra = any(within(e.importer, (a,)) and within(e.imported, (b,)) for a, b in PURE_EXTRAS)
        if not extra and not within(e.imported, PURE_MAY_IMPORT):
            bad.add(
                f"{e.where}: {e.importer} imports {e.imported}: {pure} imports only the standard "
                f"library, swarm floors 0-1 and {POLICY} (purity)"
            )
            continue
        target = _resolve(e.imported, nodes) if _project(e.imported) else None
        if target and (chain := _impure_chain(target, graph, libs)):
            bad.add(f"{e.where}: {e.importer} imports {chain}: {pure} must stay pure (purity)")
    for e in found:  # importing `scheduler.sim` runs `scheduler/__init__.py` first
        pure = next((p for p in (POLICY, SIM) if within(e.importer, (p,))), None)
        for parent in _parents(pure or ""):
            if chain := _impure_chain(parent, graph, libs):
                bad.add(f"{e.where}: {e.importer} runs {chain}: {pure} must stay pure (purity)")
    return sorted(bad)


# Third-party confinement.


def _is_grpc(name: str) -> bool:
    return _top(name) in GRPC or re.fullmatch(r"swarm\.proto\.\w+_pb2_grpc", name) is not None


def unconfined(found: Iterable[Edge]) -> list[str]:
    bad = set()
    for e in found:
        if _top(e.imported) in MQTT and not within(e.importer, (MQTT_HOME,)):
            bad.add(f"{e.where}: {e.importer} imports {e.imported}: MQTT only in {MQTT_HOME}")
        if _is_grpc(e.imported) and not within(e.importer, (*GRPC_SHARED, *GRPC_ROLES)):
            bad.add(
                f"{e.where}: {e.importer} imports {e.imported}: gRPC only where the wire is "
                "(GRPC_SHARED, or a role module that serves or dials: GRPC_ROLES)"
            )
    return sorted(bad)


# One hop loop.


def _receiver(node: ast.expr) -> str:
    """The name a call's receiver goes by: `pool`; `self._pools[s]` -> `_pools`;
    `wiring.pool(s)` -> `pool`."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return ""


def books_kept(module: str, source: str, path: str) -> list[str]:
    """The wiring's bookkeeping calls in `module` outside `BOOK_KEEPERS`."""
    if within(module, BOOK_KEEPERS):
        return []
    calls = [
        n
        for n in ast.walk(ast.parse(source, path))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in BOOKKEEPING
        and WIRING.search(_receiver(n.func.value))
    ]
    return [
        f"{path}:{n.lineno}: {module} calls {ast.unparse(n.func)}(): only {HOP} (the one hop "
        "loop) keeps the wiring's books"
        for n in sorted(calls, key=lambda n: (n.lineno, n.col_offset))
        if isinstance(n.func, ast.Attribute)
    ]


# Loading modules by name.


def loads_by_name(module: str, source: str, path: str) -> list[str]:
    """Uses of `importlib.import_module`, `__import__`, `spec_from_*`, `module_from_spec`."""
    if module == DISPATCHER:
        return []
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name) for a in node.names if LOADERS.fullmatch(a.name)]
        elif isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if LOADERS.fullmatch(name):
                found.append((node.lineno, name))
    return [
        f"{path}:{line}: {module} uses {name}: only the CLI dispatcher ({DISPATCHER}) loads "
        "modules by name"
        for line, name in sorted(found)
    ]


# Tests' helpers.


def helper_imports(found: Iterable[Edge], known: Mapping[str, str] = HELPER_SOURCES) -> list[str]:
    """Imports of a module under tests/ other than `SUPPORT`'s and conftest files, unless `known`
    names it; and entries of `known` that nothing imports any more."""
    bad: set[str] = set()
    used: set[str] = set()
    for e in found:
        if not within(e.imported, (TESTS,)) or within(e.imported, (SUPPORT,)):
            continue
        if e.imported.rpartition(".")[2] == "conftest":
            continue
        if e.imported in known:
            used.add(e.imported)
            continue
        bad.add(
            f"{e.where}: {e.importer} imports {e.imported}: tests take shared helpers only from "
            "tests/support/"
        )
    return [
        *sorted(bad),
        *(f"HELPER_SOURCES {m}: nothing imports it; remove it" for m in known if m not in used),
    ]


# The training rule's keys.


def _section(node: ast.expr) -> str:
    """The name `node` goes by as a job section: `pool`, `job.pool` -> `pool`; `raw["pool"]` ->
    `pool`; else ""."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _constant(node.slice)
    return ""


def _constant(node: ast.expr) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _key_read(node: ast.expr) -> tuple[ast.expr, str] | None:
    """(section, key) when `node` takes a key from something: `s.key`, `s["key"]`,
    `getattr(s, "key")`, `s.get("key")`."""
    if isinstance(node, ast.Attribute):
        return node.value, node.attr
    if isinstance(node, ast.Subscript) and (key := _constant(node.slice)):
        return node.value, key
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1:
            return node.args[0], _constant(node.args[1])
        if isinstance(func, ast.Attribute) and func.attr == "get":
            return func.value, _constant(node.args[0])
    return None


def rule_reads(module: str, source: str, path: str) -> list[str]:
    """Reads of `RULE_KEYS` in `module` outside `RULE_HOME`."""
    if within(module, (RULE_HOME,)):
        return []
    reads = [
        (n, read)
        for n in ast.walk(ast.parse(source, path))
        if isinstance(n, ast.expr)
        and (read := _key_read(n))
        and read[1] in RULE_KEYS.get(_section(read[0]), ())
    ]
    return [
        f"{path}:{n.lineno}: {module} reads {_section(section)}.{key} ({ast.unparse(n)}): only "
        f"{RULE_HOME} reads the keys that choose the training rule; ask its Rule (rule_of)"
        for n, (section, key) in sorted(reads, key=lambda r: (r[0].lineno, r[0].col_offset))
    ]


def rule_key_violations(
    found: Iterable[tuple[str, str, str]], known: Mapping[str, str] = KNOWN_RULE_READS
) -> list[str]:
    """`rule_reads` of each (module, source, path) not in `known`, and entries of `known` that
    read no rule key any more."""
    bad: list[str] = []
    used: set[str] = set()
    for module, source, path in found:
        reads = rule_reads(module, source, path)
        if reads and module in known:
            used.add(module)
        else:
            bad += reads
    return bad + [
        f"KNOWN_RULE_READS {m}: reads no rule key; remove it" for m in known if m not in used
    ]


# Trust's rooms.


def room_of(name: str) -> str | None:
    """The trust room (`TRUST_ROOMS`) that holds module `name`, if any."""
    return next((room for room in TRUST_ROOMS if within(name, (room,))), None)


def trust_violations(
    found: Iterable[Edge],
    modules: Iterable[tuple[str, str]],
    doors: Mapping[str, str] = TRUST_DOORS,
) -> list[str]:
    """Modules (name, path) named for trust outside a room; imports of a room from outside the
    rooms but at a door; a room's imports of what it sits beside; and doors no longer used."""
    bad: set[str] = set()
    used: set[str] = set()
    for name, path in modules:
        named = TRUST_NAMED.search(name.rpartition(".")[2])
        if named and within(name, TRUST_HOMES) and room_of(name) is None:
            bad.add(
                f"{path}:1: {name} is named for trust but lives outside its rooms "
                f"({', '.join(TRUST_ROOMS)})"
            )
    for e in found:
        room, there = room_of(e.importer), room_of(e.imported)
        if there is not None and room is None:
            if e.importer in doors:
                used.add(e.importer)
            else:
                bad.add(
                    f"{e.where}: {e.importer} imports {e.imported}: only a door (TRUST_DOORS) "
                    "imports a trust room; wrap the plane, do not thread it"
                )
        if room is not None and within(e.imported, TRUST_ROOMS[room]):
            bad.add(
                f"{e.where}: {e.importer} imports {e.imported}: a trust room is given what it "
                "acts through, and imports none of what it sits beside"
            )
    return [
        *sorted(bad),
        *(f"TRUST_DOORS {m}: imports no trust room; remove it" for m in doors if m not in used),
    ]


def unmapped_trust(modules: Iterable[tuple[str, str]], named: Iterable[str]) -> list[str]:
    """Modules (name, path) of a trust room that the concept map does not name: trust's
    modules are where the map says, whatever their size."""
    named = set(named)
    return [
        f"{path}:1: {name} is a trust module: name it in {DOC_TABLES[0][0]}'s map "
        f"('{DOC_TABLES[0][1]}')"
        for name, path in sorted(modules)
        if room_of(name) is not None and not path.endswith("__init__.py") and path not in named
    ]


# The boundary's key.


def boundary_reads(module: str, source: str, path: str) -> list[str]:
    """Reads of `BOUNDARY_KEY` in `module` outside `BOUNDARY_HOME`."""
    if within(module, (BOUNDARY_HOME,)):
        return []
    reads = [
        n
        for n in ast.walk(ast.parse(source, path))
        if isinstance(n, ast.expr) and (read := _key_read(n)) and read[1] == BOUNDARY_KEY
    ]
    return [
        f"{path}:{n.lineno}: {module} reads {BOUNDARY_KEY} ({ast.unparse(n)}): only "
        f"{BOUNDARY_HOME} reads it; ask the job's Boundary (swarm.model.boundary.boundary_of)"
        for n in sorted(reads, key=lambda n: (n.lineno, n.col_offset))
    ]


def boundary_key_violations(
    found: Iterable[tuple[str, str, str]], known: Mapping[str, str] = KNOWN_BOUNDARY_READS
) -> list[str]:
    """`boundary_reads` of each (module, source, path) not in `known`, and entries of `known`
    that read the key no more."""
    bad: list[str] = []
    used: set[str] = set()
    for module, source, path in found:
        reads = boundary_reads(module, source, path)
        if reads and module in known:
            used.add(module)
        else:
            bad += reads
    return bad + [
        f"KNOWN_BOUNDARY_READS {m}: reads {BOUNDARY_KEY} no more; remove it"
        for m in known
        if m not in used
    ]


# Import circles.


def import_graph(found: Iterable[Edge]) -> dict[str, dict[str, str]]:
    """Project module -> each project module it imports -> where (its first such import). An edge
    goes to the module named (a package's `__init__` when a package is named), not to the parents
    that importing it runs first: a module may import its own package's siblings."""
    graph: dict[str, dict[str, str]] = {}
    for e in found:
        if _project(e.importer) and _project(e.imported) and e.imported != e.importer:
            graph.setdefault(e.importer, {}).setdefault(e.imported, e.where)
    return graph


def _reachable(start: str, graph: Mapping[str, Mapping[str, str]]) -> set[str]:
    seen: set[str] = set()
    queue = deque([start])
    while queue:
        for after in graph.get(queue.popleft(), {}):
            if after not in seen:
                seen.add(after)
                queue.append(after)
    return seen


def _shortest_circle(
    start: str, graph: Mapping[str, Mapping[str, str]], members: set[str]
) -> list[str]:
    """The shortest path from `start` back to itself through `members` (one exists)."""
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for after in sorted(set(graph[here]) & members):
            if after == start:
                return [*paths[here], start]
            if after not in paths:
                paths[after] = [*paths[here], after]
                queue.append(after)
    raise AssertionError(f"{start} is in no circle")


def circles(found: Iterable[Edge]) -> dict[tuple[str, ...], str]:
    """Each import circle (the modules that reach each other), its modules sorted -> the shortest
    circle through its first module, `a -> b -> a (where a imports b, where b imports a)`."""
    graph = import_graph(found)
    reach = {n: _reachable(n, graph) for n in graph}
    found_circles: dict[tuple[str, ...], str] = {}
    for node in sorted(graph):
        members = tuple(sorted(m for m in reach[node] if node in reach.get(m, ())))
        if not members or members in found_circles:
            continue
        cycle = _shortest_circle(members[0], graph, set(members))
        where = ", ".join(graph[a][b] for a, b in pairwise(cycle))
        others = sorted(set(members) - set(cycle))
        also = f"; also in this circle: {', '.join(others)}" if others else ""
        found_circles[members] = f"{' -> '.join(cycle)} ({where}){also}"
    return found_circles


def circle_violations(
    found: Iterable[Edge], known: Mapping[tuple[str, ...], str] = KNOWN_CIRCLES
) -> list[str]:
    """Circles not in `known`, and entries of `known` that are no longer exactly a circle."""
    found_circles = circles(found)
    return [
        *(f"import circle: {text}" for m, text in sorted(found_circles.items()) if m not in known),
        *(
            f"KNOWN_CIRCLES {', '.join(m)}: no longer exactly a circle; remove or correct it"
            for m in known
            if m not in found_circles
        ),
    ]


# The docs' maps.


def table(markdown: str, heading: str) -> list[tuple[int, str]]:
    """The rows (line number, text) of the first table under `heading`, header excluded; [] when
    that section has none."""
    lines = markdown.splitlines()
    start = next(
        (i for i, t in enumerate(lines) if t.startswith("#") and t.lstrip("#").strip() == heading),
        None,
    )
    if start is None:
        return []
    rows: list[tuple[int, str]] = []
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("#") or (rows and not lines[i].startswith("|")):
            break
        if lines[i].startswith("|"):
            rows.append((i + 1, lines[i]))
    return rows[2:]  # the header and its rule


def map_paths(
    rows: Iterable[tuple[int, str]], exists: Callable[[str], bool]
) -> Iterator[tuple[int, str, str, bool]]:
    """(line, token, path, rooted) of each path in backticks in `rows`. A path whose first part is
    no top-level entry (`sim/`, `wiring.py`) is read in the row's last top-level path
    (`scheduler/`): it is not `rooted`."""
    for line, text in rows:
        base = ""
        for token in re.findall(r"`([^`]+)`", text):
            if not PATHLIKE.fullmatch(token) or (
                "/" not in token and not FILELIKE.fullmatch(token)
            ):
                continue
            rooted = not base or exists(token.split("/")[0])
            path = token if rooted else base + token
            yield line, token, path, rooted
            if rooted:
                base = path if path.endswith("/") else path.rpartition("/")[0] + "/"
                base = "" if base == "/" else base


def missing_paths(
    doc: str, rows: Iterable[tuple[int, str]], exists: Callable[[str], bool]
) -> list[str]:
    """Paths in backticks in `rows` that do not exist."""
    return [
        f"{doc}:{line}: `{token}`{'' if rooted else f' (read as {path})'} does not exist (the "
        "map is stale)"
        for line, token, path, rooted in map_paths(rows, exists)
        if not exists(path.rstrip("/"))
    ]


# Module sizes.


def sizes(root: Path = ROOT) -> dict[str, tuple[str, int]]:
    """Every project module written by hand -> (its path, its lines)."""
    return {
        name: (str(path.relative_to(root)), len(path.read_text().splitlines()))
        for name, path in project_modules(root).items()
        if not GENERATED.fullmatch(name)
    }


def oversize(
    found: Mapping[str, tuple[str, int]], allowed: Mapping[str, str] = OVERSIZE
) -> list[str]:
    """Modules over `BUDGET` lines not in `allowed`, and entries of `allowed` within it."""
    return [
        *(
            f"{path}:1: {name} has {lines} lines, over the {BUDGET}-line budget: split it by "
            "concept (or name it in OVERSIZE with the reason it is one)"
            for name, (path, lines) in sorted(found.items())
            if lines > BUDGET and name not in allowed
        ),
        *(
            f"OVERSIZE {name}: {found[name][1]} lines, within the budget; remove it"
            if name in found
            else f"OVERSIZE {name}: no such module; remove it"
            for name in allowed
            if found.get(name, ("", 0))[1] <= BUDGET
        ),
    ]


def function_lengths(root: Path = ROOT) -> dict[str, tuple[str, int, int]]:
    """Every function of the hand-written project modules, `module:Class.name` (nested ones
    under their parent's name) -> (its path, its first line, its lines)."""
    found: dict[str, tuple[str, int, int]] = {}
    for module, path in project_modules(root).items():
        if GENERATED.fullmatch(module):
            continue
        where = str(path.relative_to(root))
        scopes: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text()), "")]
        while scopes:
            node, prefix = scopes.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}{child.name}"
                    scopes.append((child, f"{name}."))
                    if not isinstance(child, ast.ClassDef):
                        lines = (child.end_lineno or child.lineno) - child.lineno + 1
                        found[f"{module}:{name}"] = (where, child.lineno, lines)
                else:
                    scopes.append((child, prefix))
    return found


def long_functions(
    found: Mapping[str, tuple[str, int, int]], allowed: Mapping[str, str] = LONG_FUNCTIONS
) -> list[str]:
    """Functions of `LONG` lines or more not in `allowed`, and entries of `allowed` under it."""
    return [
        *(
            f"{path}:{line}: {name} has {lines} lines: make it read as the step does, one "
            "function a thing it does, named as DESIGN names it (or name it in LONG_FUNCTIONS "
            "with the reason it is one)"
            for name, (path, line, lines) in sorted(found.items())
            if lines >= LONG and name not in allowed
        ),
        *(
            f"LONG_FUNCTIONS {name}: {found[name][2]} lines, under {LONG}; remove it"
            if name in found
            else f"LONG_FUNCTIONS {name}: no such function; remove it"
            for name in allowed
            if found.get(name, ("", 0, 0))[2] < LONG
        ),
    ]


def format_offs(files: Mapping[str, str]) -> list[str]:
    """`path:line` of each comment in `files` (path -> source) that turns the formatter off."""
    bad = []
    for path, source in sorted(files.items()):
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        bad += [
            f"{path}:{token.start[0]}: '{token.string.strip()}': format the code instead (split "
            "a long call over lines, or a long module by concept)"
            for token in tokens
            if token.type == tokenize.COMMENT and FORMAT_OFF.search(token.string)
        ]
    return bad


def hand_written_python(root: Path = ROOT) -> dict[str, str]:
    """Every Python file under `FORMATTED_DIRS` but the generated messages: path -> source."""
    generated = root / "swarm" / "proto"
    return {
        str(path.relative_to(root)): path.read_text()
        for top in FORMATTED_DIRS
        for path in sorted((root / top).rglob("*.py"))
        if generated not in path.parents
    }


def unmapped(found: Mapping[str, tuple[str, int]], named: Iterable[str]) -> list[str]:
    """Modules over `MAPPED` lines whose file the concept map does not name."""
    named = set(named)
    return [
        f"{path}:1: {name} has {lines} lines and is its own concept: name it in "
        f"{DOC_TABLES[0][0]}'s map ('{DOC_TABLES[0][1]}')"
        for name, (path, lines) in sorted(found.items())
        if lines > MAPPED and path not in named
    ]


# The tree.


def test_no_forbidden_imports() -> None:
    bad = forbidden(edges())
    if bad:
        pytest.fail("imports that break the layering (docs/architecture.md):\n" + "\n".join(bad))


def test_tables_are_still_needed() -> None:
    unused = stale(edges())
    if unused:
        pytest.fail("table entries no module needs any more; remove them:\n" + "\n".join(unused))


def test_the_tables_name_real_modules() -> None:
    modules = project_modules()
    named = [
        *(u for units in FLOORS for u in units),
        POLICY,
        SIM,
        HOP,
        DISPATCHER,
        *(m for pair in ALLOWED for m in pair),
        *(m for pair in KNOWN_SUBPACKAGE_IMPORTS for m in pair),
        *GRPC_SHARED,
        *GRPC_ROLES,
        *(a for a, _ in PURE_EXTRAS),
        *TRUST_ROOMS,
        *(m for beside in TRUST_ROOMS.values() for m in beside),
        *TRUST_DOORS,
    ]
    missing = sorted({m for m in named if not any(within(n, (m,)) for n in modules)})
    assert not missing, f"the tables name modules that do not exist: {missing}"


def test_subpackages_import_only_their_siblings() -> None:
    bad = reaches_up(edges(), role_packages())
    if bad:
        pytest.fail("a role's subpackage reaching up or across:\n" + "\n".join(bad))


def test_no_two_way_tie_between_siblings() -> None:
    bad = sibling_ties(edges(), role_packages())
    if bad:
        pytest.fail("sibling subpackages that import each other:\n" + "\n".join(bad))


def test_floors() -> None:
    modules = ((n, str(p.relative_to(ROOT))) for n, p in project_modules().items())
    bad = unfloored(modules) + floor_violations(edges())
    if bad:
        pytest.fail("swarm's floors (FLOORS) are broken:\n" + "\n".join(bad))


def test_the_policies_and_the_simulator_are_pure() -> None:
    bad = impure(edges())
    if bad:
        pytest.fail("impure imports in the policies or the simulator:\n" + "\n".join(bad))


def test_third_party_libraries_are_confined() -> None:
    bad = unconfined(edges())
    if bad:
        pytest.fail("MQTT or gRPC outside its place:\n" + "\n".join(bad))


def test_one_hop_loop() -> None:
    bad = [m for args in sources() for m in books_kept(*args)]
    if bad:
        pytest.fail(f"the wiring's books kept outside {HOP}:\n" + "\n".join(bad))


def test_only_the_dispatcher_loads_modules_by_name() -> None:
    bad = [m for args in sources() for m in loads_by_name(*args)]
    if bad:
        pytest.fail("modules loaded by name outside the CLI dispatcher:\n" + "\n".join(bad))


def test_only_the_job_reads_the_rule_keys() -> None:
    bad = rule_key_violations(sources())
    if bad:
        pytest.fail(f"the training rule's keys read outside {RULE_HOME}:\n" + "\n".join(bad))


def test_trust_has_its_rooms() -> None:
    modules = [(n, str(p.relative_to(ROOT))) for n, p in project_modules().items()]
    doc, heading, _ = DOC_TABLES[0]
    rows = table((ROOT / doc).read_text(), heading)
    named = [path for _, _, path, _ in map_paths(rows, lambda p: (ROOT / p).exists())]
    bad = trust_violations(edges(), modules) + unmapped_trust(modules, named)
    if bad:
        pytest.fail("trust threaded through the planes:\n" + "\n".join(bad))


def test_only_the_model_reads_the_boundary_key() -> None:
    bad = boundary_key_violations(sources())
    if bad:
        pytest.fail(f"{BOUNDARY_KEY} read outside {BOUNDARY_HOME}:\n" + "\n".join(bad))


def test_no_import_circles() -> None:
    bad = circle_violations(edges())
    if bad:
        pytest.fail("import circles between project modules:\n" + "\n".join(bad))


def test_tests_take_helpers_only_from_support() -> None:
    bad = helper_imports(suite_edges())
    if bad:
        pytest.fail("tests importing helpers from other test files:\n" + "\n".join(bad))


def test_modules_keep_to_the_budget() -> None:
    bad = oversize(sizes())
    if bad:
        pytest.fail(f"modules over {BUDGET} lines (one concept, one file):\n" + "\n".join(bad))


def test_functions_keep_under_the_length() -> None:
    bad = long_functions(function_lengths())
    if bad:
        pytest.fail(f"functions of {LONG} lines or more:\n" + "\n".join(bad))


def test_no_code_turns_the_formatter_off() -> None:
    bad = format_offs(hand_written_python())
    if bad:
        pytest.fail("code kept from the formatter:\n" + "\n".join(bad))


def test_the_concept_map_names_every_large_module() -> None:
    doc, heading, _ = DOC_TABLES[0]
    rows = table((ROOT / doc).read_text(), heading)
    named = (path for _, _, path, _ in map_paths(rows, lambda p: (ROOT / p).exists()))
    bad = unmapped(sizes(), named)
    if bad:
        pytest.fail(f"modules over {MAPPED} lines missing from the concept map:\n" + "\n".join(bad))


def test_the_concept_map_is_true() -> None:
    bad: list[str] = []
    for doc, heading, required in DOC_TABLES:
        rows = table((ROOT / doc).read_text(), heading)
        assert rows or not required, f"{doc}: no table under '{heading}' (the concept map)"
        bad += missing_paths(doc, rows, lambda p: (ROOT / p).exists())
    if bad:
        pytest.fail("paths in the docs' maps that do not exist:\n" + "\n".join(bad))


def test_the_job_commands_start_without_torch() -> None:
    # `swarm submit/status/list/cancel` are what a user types again and again (and what the
    # integration tests poll): importing torch would cost each of them seconds of CPU.
    code = "import sys, client.commands; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.strip() == "False", result.stderr


# Seeded violations: each checker reports a planted violation and passes an allowed case.

KNOWN = {
    "scheduler.wiring",
    "stage_server.agent",
    "stage_server.peer.limits",
    "stage_server.replica.step_sums",
    "scheduler.store",
    "client.trainer",
    "stage_server.runtime",
    "swarm.net.tls",
    "swarm.proto.stage_pb2_grpc",
}


def _edges_of(module: str, source: str, package: bool = False) -> list[Edge]:
    return list(imports_of(module, source, package=package, known=KNOWN, path="x.py"))


def test_the_role_checker() -> None:
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
        "scheduler.wiring",
        "client.trainer",
        "scheduler.store",
        "stage_server.runtime",
    ]
    assert forbidden(found) == [
        "x.py:2: stage_server.fake imports scheduler.wiring: roles meet only over ALLOWED",
        "x.py:4: stage_server.fake imports client.trainer: roles meet only over ALLOWED",
        "x.py:5: stage_server.fake imports scheduler.store: roles meet only over ALLOWED",
    ]
    # `swarm` imports no role; the simulator imports itself, not the service shell.
    assert forbidden(_edges_of("swarm.fake", "from scheduler.sim import simulate\n")) == [
        "x.py:1: swarm.fake imports scheduler.sim: swarm imports no role"
    ]
    assert not forbidden(_edges_of("scheduler.sim.x", "from scheduler.sim.model import A\n"))
    assert forbidden(_edges_of("scheduler.sim.x", "from scheduler.store import JobStore\n"))
    # Allowed edges hold only from their own importer; relative imports in a package resolve.
    assert not forbidden(_edges_of("scheduler.job_training", "from client.trainer import T\n"))
    assert forbidden(_edges_of("scheduler.job_api", "from client.trainer import T\n"))
    assert _edges_of("client", "from .trainer import T\n", package=True)[0].imported == (
        "client.trainer"
    )
    assert stale([]) == [
        *(f"ALLOWED {a} -> {b}" for a, b in ALLOWED),
        *(f"GRPC_ROLES {a}" for a in GRPC_ROLES),
        *(f"PURE_EXTRAS {a} -> {b}" for a, b in PURE_EXTRAS),
    ]


def test_the_subpackage_checker() -> None:
    packages = {"stage_server", "stage_server.replica", "stage_server.peer", "client"}
    packages |= {"client.data_plane"}
    source = (
        "import torch\n"
        "from swarm.device.oom import named\n"
        "from stage_server.peer.limits import PeerLimits\n"  # a sibling
        "from . import step_sums\n"  # itself
        "from stage_server.servicer import StageServicer\n"
        "def late():\n"
        "    from stage_server import agent\n"
        "    import stage_server\n"
        "    from scheduler.store import JobStore\n"
    )
    found = _edges_of("stage_server.replica.fake", source)
    assert reaches_up(found, packages, {}) == [
        "x.py:5: stage_server.replica.fake imports stage_server.servicer (a top-level module of "
        "its role): a role's subpackage imports only itself, its siblings and swarm",
        "x.py:7: stage_server.replica.fake imports stage_server.agent (a top-level module of its "
        "role): a role's subpackage imports only itself, its siblings and swarm",
        "x.py:8: stage_server.replica.fake imports stage_server (a top-level module of its role): "
        "a role's subpackage imports only itself, its siblings and swarm",
        "x.py:9: stage_server.replica.fake imports scheduler.store (another role): a role's "
        "subpackage imports only itself, its siblings and swarm",
    ]
    # A subpackage's own package module is in it; a role's top-level modules import freely.
    assert not reaches_up(
        _edges_of("stage_server.replica", "from . import step_sums\n", package=True), packages, {}
    )
    assert not reaches_up(
        _edges_of("stage_server.servicer", "from stage_server.agent import A\n"), packages, {}
    )
    # An allowed edge holds only from its own subpackage; a stale entry is named.
    known = {
        ("client.data_plane", "client.metrics"): "the trainer's series",
        ("client.data_plane", "client.trainer"): "stale",
    }
    found = _edges_of("client.data_plane.fake", "from client.metrics import TrainerMetrics\n")
    assert reaches_up(found, packages, known) == [
        "KNOWN_SUBPACKAGE_IMPORTS client.data_plane -> client.trainer: no longer imported; "
        "remove it"
    ]
    assert reaches_up(found, packages, {})
    assert subpackage_of("stage_server.replica.runtime", packages) == "stage_server.replica"
    assert subpackage_of("stage_server.cli", packages) is None
    assert subpackage_of("swarm.device.oom", packages | {"swarm.ops"}) is None


def test_the_sibling_tie_checker() -> None:
    packages = {"stage_server", "stage_server.replica", "stage_server.peer"}
    packages |= {"stage_server.averaging", "client", "client.data_plane"}
    # The tie issue 66 found: the peer's speed measurement built a replica's runtime.
    found = [
        *_edges_of("stage_server.peer.measure", "from stage_server.replica.runtime import R\n"),
        *_edges_of("stage_server.replica.messages", "from stage_server.peer.limits import L\n"),
        *_edges_of("stage_server.replica.commit", "from stage_server.peer.metrics import M\n"),
    ]
    assert sibling_ties(found, packages) == [
        "x.py:1: stage_server.peer imports stage_server.replica (stage_server.peer.measure -> "
        "stage_server.replica.runtime) and x.py:1: stage_server.replica imports "
        "stage_server.peer (stage_server.replica.commit -> stage_server.peer.metrics): sibling "
        "subpackages are tied one way only; move what one needs of the other into the one it "
        "imports"
    ]
    # One way only, a subpackage importing itself, a role's top-level module both ways: fine.
    fine = [
        *found[1:],
        *_edges_of("stage_server.replica.worker", "from stage_server.averaging.a import A\n"),
        *_edges_of("stage_server.replica.worker", "from stage_server.replica.runtime import R\n"),
        *_edges_of("stage_server.agent", "from stage_server.peer.limits import L\n"),
        *_edges_of("stage_server.peer.x", "import stage_server.agent\n"),
        *_edges_of("client.data_plane.x", "from stage_server.peer.limits import L\n"),
    ]
    assert sibling_ties(fine, packages) == []


def test_the_floor_checker() -> None:
    up = _edges_of("swarm.net.fake", "from swarm.rpc.status import to_status\n")
    assert floor_violations(up) == [
        "x.py:1: swarm.net.fake (floor 1) imports swarm.rpc.status (floor 4): a swarm module "
        "imports only its own package and lower floors"
    ]
    assert floor_violations(_edges_of("swarm.bus.fake", "from swarm.rpc import lease\n"))
    assert floor_violations(_edges_of("swarm.bus.fake", "import swarm.nowhere\n")) == [
        "x.py:1: swarm.bus.fake imports swarm.nowhere, which is on no floor"
    ]
    assert unfloored([("swarm.nowhere.x", "swarm/nowhere/x.py")]) == [
        "swarm/nowhere/x.py:1: swarm.nowhere.x is on no floor; name its floor in FLOORS"
    ]
    source = "from swarm.errors import E\nfrom swarm.policy import backoff\nfrom . import topics\n"
    assert not floor_violations(_edges_of("swarm.bus.fake", source))
    assert not floor_violations(_edges_of("client.fake", "from swarm.commands import main\n"))
    assert not unfloored([("swarm.rpc.hop", "swarm/rpc/hop.py"), ("swarm", "swarm/__init__.py")])


def test_the_purity_checker() -> None:
    direct = _edges_of("swarm.policy.fake", "import torch\nimport swarm.bus.api\n")
    assert impure(direct) == [
        "x.py:1: swarm.policy.fake imports torch: swarm.policy imports only the standard library, "
        "swarm floors 0-1 and swarm.policy (purity)",
        "x.py:2: swarm.policy.fake imports swarm.bus.api: swarm.policy imports only the standard "
        "library, swarm floors 0-1 and swarm.policy (purity)",
    ]
    # Through a floor-1 module that is itself impure: the chain is named.
    found = [
        *_edges_of("scheduler.sim.fake", "def f():\n    from swarm.net.tls import t\n"),
        *_edges_of("swarm.net.tls", "import grpc\n"),
        *_edges_of("swarm.net", "", package=True),
    ]
    assert impure(found) == [
        "x.py:2: scheduler.sim.fake imports swarm.net.tls -> grpc: scheduler.sim must stay pure "
        "(purity)"
    ]
    found = [
        *_edges_of("scheduler.sim.fake", "import math\n"),
        *_edges_of("scheduler", "import prometheus_client\n", package=True),
    ]
    assert impure(found) == [
        "x.py:1: scheduler.sim.fake runs scheduler -> prometheus_client: scheduler.sim must stay "
        "pure (purity)"
    ]
    source = "import math\nfrom swarm.errors import E\nfrom swarm.policy import wiring\n"
    assert not impure(_edges_of("scheduler.sim.fake", source))
    assert not impure(_edges_of("scheduler.sim.cli", "def plot():\n    import matplotlib\n"))
    assert not impure(_edges_of("scheduler.fake", "import torch\n"))  # not a pure module


def test_the_confinement_checker() -> None:
    found = _edges_of("swarm.ops.fake", "import aiomqtt\nfrom swarm.proto import stage_pb2_grpc\n")
    assert unconfined(found) == [
        "x.py:1: swarm.ops.fake imports aiomqtt: MQTT only in swarm.bus",
        "x.py:2: swarm.ops.fake imports swarm.proto.stage_pb2_grpc: gRPC only where the wire is "
        "(GRPC_SHARED, or a role module that serves or dials: GRPC_ROLES)",
    ]
    assert unconfined(_edges_of("client.trainer", "import grpc\n"))
    assert not unconfined(_edges_of("swarm.bus.link", "import aiomqtt\n"))
    assert not unconfined(_edges_of("swarm.rpc.fake", "import grpc\n"))
    assert not unconfined(_edges_of("stage_server.server", "from grpc_health.v1 import health\n"))


def test_the_hop_checker() -> None:
    source = (
        "async def hop(pool, wiring, self):\n"
        "    pool.started(peer, 1)\n"
        "    self._pools[stage].failed(peer)\n"
        "    wiring.pool(stage).finished(peer, 1, 0.1)\n"
        "    self.metrics.failed(stage, peer)\n"  # not the wiring's books
        "    self._joins.failed(peer)\n"
        "    task.done()\n"
    )
    assert books_kept("client.fake", source, "x.py") == [
        "x.py:2: client.fake calls pool.started(): only swarm.rpc.hop (the one hop loop) keeps "
        "the wiring's books",
        "x.py:3: client.fake calls self._pools[stage].failed(): only swarm.rpc.hop (the one hop "
        "loop) keeps the wiring's books",
        "x.py:4: client.fake calls wiring.pool(stage).finished(): only swarm.rpc.hop (the one "
        "hop loop) keeps the wiring's books",
    ]
    for keeper in ("swarm.rpc.hop", "swarm.policy.stage_pool", "scheduler.sim.engine"):
        assert not books_kept(keeper, source, "x.py")


def test_the_loader_checker() -> None:
    source = (
        "import importlib\n"
        "from importlib import import_module\n"
        "m = importlib.import_module('client.cli')\n"
        "n = __import__('scheduler.cli')\n"
        "s = importlib.util.spec_from_file_location('x', 'x.py')\n"
        "o = importlib.util.module_from_spec(s)\n"
    )
    assert [
        m.split(" uses ")[1].split(":")[0] for m in loads_by_name("client.x", source, "x.py")
    ] == [
        "import_module",
        "import_module",
        "__import__",
        "spec_from_file_location",
        "module_from_spec",
    ]
    assert loads_by_name("client.x", source, "x.py")[0] == (
        "x.py:2: client.x uses import_module: only the CLI dispatcher (swarm.cli) loads modules "
        "by name"
    )
    assert not loads_by_name("swarm.cli", source, "x.py")
    harmless = (
        "import importlib.resources\n"
        "import importlib.util\n"
        "ok = importlib.util.find_spec('matplotlib') is not None\n"
        "files = importlib.resources.files('grpc_tools')\n"
    )
    assert not loads_by_name("scheduler.sim.cli", harmless, "x.py")


def test_the_concept_map_checker() -> None:
    doc = (
        "# Title\n"
        "## Where each concept lives\n"
        "Prose with `swarm/gone.py`, not in the table.\n"
        "\n"
        "| concept | where |\n"
        "|---|---|\n"
        "| hop loop (`Hop`) | `swarm/rpc/hop.py` (+ `routes.py`, `gone.py`) |\n"
        "| the simulator | `scheduler/` (`sim/`, `swarm.model.partition`, `swarm status`) |\n"
        "| gone | `swarm/bus_api.py`, `nowhere/` |\n"
        "\n"
        "| another | table |\n"
        "|---|---|\n"
        "| ignored | `swarm/gone.py` |\n"
    )
    tree = {"swarm", "swarm/rpc", "swarm/rpc/hop.py", "swarm/rpc/routes.py", "scheduler"}
    tree |= {"scheduler/sim"}
    rows = table(doc, "Where each concept lives")
    assert [line for line, _ in rows] == [7, 8, 9]
    assert missing_paths("d.md", rows, tree.__contains__) == [
        "d.md:7: `gone.py` (read as swarm/rpc/gone.py) does not exist (the map is stale)",
        "d.md:9: `swarm/bus_api.py` does not exist (the map is stale)",
        "d.md:9: `nowhere/` (read as swarm/nowhere/) does not exist (the map is stale)",
    ]
    assert table(doc, "Layout") == []


def test_the_trust_room_checker() -> None:
    found = [
        # the carry plane threading the audit through its loop: the violation issue 66 removed
        *_edges_of("client.data_plane.carry", "from client.audit.audits import Audits, Work\n"),
        # the wrapper reaching back into the plane it wraps
        *_edges_of("client.audit.audited", "from client.data_plane.boundary import Answer\n"),
        *_edges_of("scheduler.coordinator.trust.bans", "import scheduler.coordinator.commit\n"),
    ]
    fine = [  # the composition point; a room importing itself and the ledger it reads
        *_edges_of("client.data_plane.plane", "from client.audit.audited import Audited\n"),
        *_edges_of("client.audit.push_audit", "from client.audit.audits import Audits\n"),
        *_edges_of("scheduler.coordinator.trust.bans", "import scheduler.coordinator.ledger\n"),
    ]
    modules = [
        ("client.data_plane.push_audit", "client/data_plane/push_audit.py"),
        ("scheduler.coordinator.bans", "scheduler/coordinator/bans.py"),
        ("scheduler.coordinator.trust.bans", "scheduler/coordinator/trust/bans.py"),
        ("scheduler.coordinator.ledger", "scheduler/coordinator/ledger.py"),
        ("scheduler.store_bans", "scheduler/store_bans.py"),  # the store's: no trainer's
    ]
    doors = {"client.data_plane.plane": "composes", "client.trainer": "stale"}
    assert trust_violations(found + fine, modules, doors) == [
        "client/data_plane/push_audit.py:1: client.data_plane.push_audit is named for trust but "
        "lives outside its rooms (client.audit, scheduler.coordinator.trust)",
        "scheduler/coordinator/bans.py:1: scheduler.coordinator.bans is named for trust but "
        "lives outside its rooms (client.audit, scheduler.coordinator.trust)",
        "x.py:1: client.audit.audited imports client.data_plane.boundary: a trust room is given "
        "what it acts through, and imports none of what it sits beside",
        "x.py:1: client.data_plane.carry imports client.audit.audits: only a door (TRUST_DOORS) "
        "imports a trust room; wrap the plane, do not thread it",
        "x.py:1: scheduler.coordinator.trust.bans imports scheduler.coordinator.commit: a trust "
        "room is given what it acts through, and imports none of what it sits beside",
        "TRUST_DOORS client.trainer: imports no trust room; remove it",
    ]
    assert not trust_violations(fine, modules[2:], {"client.data_plane.plane": "composes"})
    rooms = [*modules, ("client.audit", "client/audit/__init__.py")]
    assert unmapped_trust(rooms, ["scheduler/coordinator/bans.py"]) == [
        "scheduler/coordinator/trust/bans.py:1: scheduler.coordinator.trust.bans is a trust "
        "module: name it in docs/architecture.md's map ('Where each concept lives')"
    ]
    assert not unmapped_trust(rooms, ["scheduler/coordinator/trust/bans.py"])


def test_the_circle_checker() -> None:
    found = [
        *_edges_of("scheduler.x", "from scheduler.y import f\n"),
        *_edges_of(
            "scheduler.y",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scheduler.z import Z\n",
        ),
        *_edges_of("scheduler.z", "import os\ndef late():\n    import scheduler.x\n"),
        *_edges_of("swarm.a", "from swarm.b import f\nimport swarm.c\n"),
        *_edges_of("swarm.b", "from swarm.a import g\n"),
        *_edges_of("swarm.c", "import swarm.b\n"),
    ]
    assert circles(found) == {
        ("scheduler.x", "scheduler.y", "scheduler.z"): (
            "scheduler.x -> scheduler.y -> scheduler.z -> scheduler.x (x.py:1, x.py:3, x.py:3)"
        ),
        ("swarm.a", "swarm.b", "swarm.c"): (
            "swarm.a -> swarm.b -> swarm.a (x.py:1, x.py:1); also in this circle: swarm.c"
        ),
    }
    known = {("swarm.a", "swarm.b", "swarm.c"): "being removed", ("swarm.a", "swarm.b"): "stale"}
    assert circle_violations(found, known) == [
        "import circle: scheduler.x -> scheduler.y -> scheduler.z -> scheduler.x (x.py:1, x.py:3, "
        "x.py:3)",
        "KNOWN_CIRCLES swarm.a, swarm.b: no longer exactly a circle; remove or correct it",
    ]
    # Allowed: a chain; a package importing its modules, which import their siblings; itself.
    fine = [
        *_edges_of("client", "from .trainer import T\n", package=True),
        *_edges_of("client.trainer", "from client.metrics import M\nimport client.trainer\n"),
        *_edges_of("client.metrics", "import torch\nfrom swarm.errors import E\n"),
        *_edges_of("swarm.errors", "import os\n"),
    ]
    assert circles(fine) == {}
    assert circle_violations(fine, {}) == []


def test_the_budget_checker() -> None:
    found = {
        "client.big": ("client/big.py", BUDGET + 1),
        "client.fine": ("client/fine.py", BUDGET),
        "client.allowed": ("client/allowed.py", BUDGET + 200),
        "client.split": ("client/split.py", 120),
    }
    allowed = {"client.allowed": "one concept", "client.split": "stale", "client.gone": "stale"}
    assert oversize(found, allowed) == [
        f"client/big.py:1: client.big has {BUDGET + 1} lines, over the {BUDGET}-line budget: "
        "split it by concept (or name it in OVERSIZE with the reason it is one)",
        "OVERSIZE client.split: 120 lines, within the budget; remove it",
        "OVERSIZE client.gone: no such module; remove it",
    ]
    fine = {n: found[n] for n in ("client.fine", "client.allowed")}
    assert not oversize(fine, {"client.allowed": "one concept"})
    assert GENERATED.fullmatch("swarm.proto.stage_pb2_grpc")
    assert not GENERATED.fullmatch("swarm.proto.framing")


def test_the_length_checker(tmp_path: Path) -> None:
    (tmp_path / "client").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(LONG - 2))
    (tmp_path / "client" / "walk.py").write_text(
        "class Plane:\n"
        "    def push(self) -> None:\n"
        "        def inner() -> None:\n"
        f"{textwrap.indent(body, '        ')}"
        "        inner()\n"
        f"def step() -> None:\n{body}\n"
    )
    found = function_lengths(tmp_path)
    assert found["client.walk:Plane.push.inner"] == ("client/walk.py", 3, LONG - 1)
    assert found["client.walk:Plane.push"] == ("client/walk.py", 2, LONG + 1)
    assert found["client.walk:step"] == ("client/walk.py", LONG + 3, LONG - 1)
    allowed = {"client.walk:step": "stale", "client.gone:f": "stale"}
    assert long_functions(found, allowed) == [
        f"client/walk.py:2: client.walk:Plane.push has {LONG + 1} lines: make it read as the "
        "step does, one function a thing it does, named as DESIGN names it (or name it in "
        "LONG_FUNCTIONS with the reason it is one)",
        f"LONG_FUNCTIONS client.walk:step: {LONG - 1} lines, under {LONG}; remove it",
        "LONG_FUNCTIONS client.gone:f: no such function; remove it",
    ]
    assert not long_functions(found, {"client.walk:Plane.push": "one step"})


def test_the_format_off_checker() -> None:
    skip, off = "# fmt" + ": skip", "# fmt" + ": off"  # not written whole: this file would match
    files = {
        "client/a.py": f"x = (1,\n     2)  {skip}\n",
        "client/b.py": f"{off}\ny = [1,2]\n",
        "client/c.py": f"z = '{skip}'  # a string, not a comment\n",
        "client/d.py": "w = 1  # fmt is not the formatter's switch here\n",
    }
    assert format_offs(files) == [
        f"client/a.py:2: '{skip}': format the code instead (split a long call over lines, or a "
        "long module by concept)",
        f"client/b.py:1: '{off}': format the code instead (split a long call over lines, or a "
        "long module by concept)",
    ]


def test_the_unmapped_checker() -> None:
    doc = (
        "## Where each concept lives\n"
        "| concept | where |\n"
        "|---|---|\n"
        "| hop loop | `swarm/rpc/hop.py` (+ `routes.py`) |\n"
        "| the simulator | `scheduler/sim/` |\n"
    )
    tree = {"swarm", "swarm/rpc/hop.py", "swarm/rpc/routes.py", "scheduler", "scheduler/sim"}
    named = [
        path
        for _, _, path, _ in map_paths(table(doc, "Where each concept lives"), tree.__contains__)
    ]
    found = {
        "swarm.rpc.hop": ("swarm/rpc/hop.py", 400),
        "swarm.rpc.routes": ("swarm/rpc/routes.py", 300),  # named as `routes.py` in hop's row
        "swarm.rpc.small": ("swarm/rpc/small.py", MAPPED),
        "scheduler.sim.engine": ("scheduler/sim/engine.py", MAPPED + 1),  # its folder is not it
    }
    assert unmapped(found, named) == [
        f"scheduler/sim/engine.py:1: scheduler.sim.engine has {MAPPED + 1} lines and is its own "
        "concept: name it in docs/architecture.md's map ('Where each concept lives')"
    ]
    assert not unmapped({n: found[n] for n in ("swarm.rpc.hop", "swarm.rpc.routes")}, named)


def test_the_helper_checker() -> None:
    source = (
        "from tests.support.jobs import job\n"
        "from tests.swarm.net.test_tls import pki\n"
        "import tests.system.test_faults\n"
        "from tests.swarm.bus import raw_mqtt\n"
        "def late():\n"
        "    from tests.conftest import anything\n"
        "    import swarm.errors\n"
    )
    found = _edges_of("tests.client.conftest", source)
    known = {"tests.system.test_faults": "moving", "tests.scheduler.test_gone": "stale"}
    assert helper_imports(found, known) == [
        "x.py:2: tests.client.conftest imports tests.swarm.net.test_tls: tests take shared "
        "helpers only from tests/support/",
        "x.py:4: tests.client.conftest imports tests.swarm.bus: tests take shared helpers only "
        "from tests/support/",
        "HELPER_SOURCES tests.scheduler.test_gone: nothing imports it; remove it",
    ]
    fine = "from tests.support import api\nimport tests.support.ports\nfrom swarm import clock\n"
    assert not helper_imports(_edges_of("tests.support.fakes", fine), {})
    assert not helper_imports(_edges_of("tests.client.test_x", fine), {})


def test_the_rule_key_checker() -> None:
    source = (
        "# pool.mode in a comment, and in a string: 'job.pool.mode'\n"
        "def f(job, pool, training, raw, self):\n"
        "    a = job.pool.mode == 'local' and self.job.pool.overlap\n"
        "    b = pool.overlap, training.delayed_update, job.training.delayed_update\n"
        "    c = raw['pool']['mode'], getattr(pool, 'mode')\n"
        "    d = raw['training'].get('delayed_update'), f'{job.pool.mode}'\n"
    )
    reads = rule_reads("client.fake", source, "x.py")
    assert [r.split(" (")[0] for r in reads] == [
        "x.py:3: client.fake reads pool.mode",
        "x.py:3: client.fake reads pool.overlap",
        "x.py:4: client.fake reads pool.overlap",
        "x.py:4: client.fake reads training.delayed_update",
        "x.py:4: client.fake reads training.delayed_update",
        "x.py:5: client.fake reads pool.mode",
        "x.py:5: client.fake reads pool.mode",
        "x.py:6: client.fake reads training.delayed_update",
        "x.py:6: client.fake reads pool.mode",
    ]
    assert reads[0] == (
        "x.py:3: client.fake reads pool.mode (job.pool.mode): only swarm.job reads the keys that "
        "choose the training rule; ask its Rule (rule_of)"
    )
    assert not rule_reads("swarm.job.rule", source, "x.py")
    # Allowed: the rule's own answers, other sections' and other things' keys of those names.
    fine = (
        "rule = rule_of(job)\n"
        "x = rule.local, rule.eager, rule.delays, job.pool.min_replicas, job.training.steps\n"
        "y = self.delayed_update, wiring.mode, stat.st_mode, job.overlap, cfg['mode']\n"
        "z = job.pool.mode_note, replace(job.pool, mode='local')\n"
    )
    assert not rule_reads("stage_server.fake", fine, "x.py")
    found = [("client.a", source, "a.py"), ("client.b", fine, "b.py")]
    known = {"client.a": "being removed", "client.b": "stale"}
    assert rule_key_violations(found, known) == [
        "KNOWN_RULE_READS client.b: reads no rule key; remove it"
    ]
    assert rule_key_violations(found, {}) == rule_reads("client.a", source, "a.py")


def test_the_boundary_key_checker() -> None:
    source = (
        "# job.model.boundary_rank in a comment, and in a string: 'cfg.boundary_rank'\n"
        "def f(job, cfg, raw, rt):\n"
        "    a = job.model.boundary_rank and rt.job.model.boundary_rank > 0\n"
        "    b = cfg.boundary_rank, raw['model']['boundary_rank'], getattr(cfg, 'boundary_rank')\n"
        "    c = raw['model'].get('boundary_rank')\n"
    )
    reads = boundary_reads("stage_server.replica.fake", source, "x.py")
    assert [r.split(" (")[0] for r in reads] == [
        "x.py:3: stage_server.replica.fake reads boundary_rank",
        "x.py:3: stage_server.replica.fake reads boundary_rank",
        "x.py:4: stage_server.replica.fake reads boundary_rank",
        "x.py:4: stage_server.replica.fake reads boundary_rank",
        "x.py:4: stage_server.replica.fake reads boundary_rank",
        "x.py:5: stage_server.replica.fake reads boundary_rank",
    ]
    assert reads[0] == (
        "x.py:3: stage_server.replica.fake reads boundary_rank (job.model.boundary_rank): only "
        "swarm.model reads it; ask the job's Boundary (swarm.model.boundary.boundary_of)"
    )
    assert not boundary_reads("swarm.model.boundary", source, "x.py")
    # Allowed: the boundary's own answers, and other keys of the model.
    fine = (
        "boundary = boundary_of(job.model)\n"
        "x = boundary.tokens(ids), boundary.width, job.model.boundary_bottleneck, cfg.d_model\n"
        "y = replace(job.model, vocab_size=2)\n"
    )
    assert not boundary_reads("client.fake", fine, "x.py")
    found = [("client.a", source, "a.py"), ("client.b", fine, "b.py")]
    known = {"client.a": "being removed", "client.b": "stale"}
    assert boundary_key_violations(found, known) == [
        "KNOWN_BOUNDARY_READS client.b: reads boundary_rank no more; remove it"
    ]
    assert boundary_key_violations(found, {}) == boundary_reads("client.a", source, "a.py")
