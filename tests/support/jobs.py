"""Job files for tests: the tiny synthetic job with any key overridden, and the keys that choose
each training rule (`RULES`); a wide vocabulary (`WIDE`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarm.job.config import JobConfig, load_job
from swarm.job.rule import RuleKind

WIDE: dict[str, Any] = {"vocab_size": 16384, "d_model": 256, "n_heads": 4}
"""`model` overrides of a wide vocabulary: stage 0's state is a 32 MiB embedding."""

BASE: dict[str, dict[str, Any]] = {
    "model": {
        "kind": "gpt",
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "seq_len": 16,
    },
    "data": {"kind": "synthetic"},
    "training": {
        "stages": 4,
        "microbatch_size": 4,
        "target_batch_size": 16,
        "steps": 3,
        "seed": 0,
        "dtype": "float64",
    },
    "optimizer": {"kind": "adamw", "lr": 1e-2, "weight_decay": 0.01},
    "compression": {"wire": "none"},
    # Audits draw from the operating system's randomness (unpredictable to a liar, by design),
    # so a test counting calls or killing at the Nth would meet a random extra re-execution:
    # off here; the tests of audits (tests/test_audits.py, tests/system/test_poison_audits.py)
    # ask for them.
    "trust": {"audit_fraction": 0.0},
}

DELAYED = {"delayed_update": True}
"""The [training] key of delayed_update: its plain rule, or with pool.overlap = "eager" its eager
one."""

LOCAL = {"mode": "local", "sync_every": 2}
"""A [pool] of local steps, rounds of two steps."""

RULES: dict[RuleKind, dict[str, dict[str, Any]]] = {
    RuleKind.SYNC: {},
    RuleKind.DELAYED: {"training": DELAYED},
    RuleKind.STEP_EAGER: {"training": DELAYED, "pool": {"overlap": "eager"}},
    RuleKind.LOCAL: {"pool": LOCAL},
    RuleKind.LOCAL_EAGER: {"pool": LOCAL | {"overlap": "eager"}},
}
"""The sections each rule (`swarm.job.rule`) needs, to pass as `write_job`'s overrides: a new rule
is a row here."""


def with_rule(kind: RuleKind, **overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`overrides` with the keys of rule `kind` added, section by section."""
    sections = {k: dict(v) for k, v in overrides.items()}
    for section, table in RULES[kind].items():
        sections[section] = sections.get(section, {}) | table
    return sections


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def render(sections: dict[str, dict[str, Any]], name: str = "test") -> str:
    lines = [f'name = "{name}"']
    for section, table in sections.items():
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write_job(directory: Path, name: str = "test", **overrides: dict[str, Any]) -> Path:
    """`overrides` maps a section to the keys to change, e.g. training={"dtype": "float32"}."""
    sections = {k: dict(v) for k, v in BASE.items()}
    for section, table in overrides.items():
        sections.setdefault(section, {}).update(table)
    path = directory / f"{name}.toml"
    path.write_text(render(sections, name))
    return path


def make_job(directory: Path, name: str = "test", **overrides: dict[str, Any]) -> JobConfig:
    return load_job(write_job(directory, name, **overrides))
