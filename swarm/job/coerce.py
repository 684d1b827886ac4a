"""The coercion engine of job files: TOML values turned into typed dataclass fields, or one
`ConfigError` a user can act on.

Why one engine: every section of a job file is held to the same rules in the same words, so a
message always names the full key (`training.dtype`), the bad value as it looks in TOML, and what
is allowed ("one of ...", "an integer >= 1", "did you mean training.steps?"). The checks run in
`Section.__post_init__`, so a job built in code is held to the rules a job file is, and each field
is normalised once to its canonical type (an int where a float is declared becomes a float, a
list a tuple, a string a `Path`): equal jobs compare and fingerprint equal however they were
written. Nothing here knows a job's sections; `swarm.job.schema` declares them.
"""

from __future__ import annotations

import difflib
import json
import math
import types
from collections.abc import Callable
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from swarm.errors import ConfigError

__all__ = [
    "GE0",
    "GE1",
    "GT0",
    "UNIT",
    "Check",
    "Section",
    "build_section",
    "checked_field",
    "not_allowed",
    "show",
    "unknown_name",
]

# (predicate, words appended to the type's description in messages)
Check = tuple[Callable[[Any], bool], str]
GE0: Check = (lambda v: v >= 0, ">= 0")
GE1: Check = (lambda v: v >= 1, ">= 1")
GT0: Check = (lambda v: v > 0, "> 0")
UNIT: Check = (lambda v: 0 <= v < 1, "in [0, 1)")
_INT64 = 2**63  # an integer field holds an int64: the job store's, torch's and gRPC's


def checked_field(default: Any = MISSING, check: Check | None = None) -> Any:
    """A dataclass field whose value must pass `check` (a predicate and its words)."""
    return field(default=default, metadata={"check": check} if check else {})


def show(value: Any) -> str:
    """Render a value as it would look in TOML-ish JSON (strings in double quotes)."""
    try:
        return json.dumps(str(value) if isinstance(value, Path) else value)
    except TypeError:
        return repr(value)


def not_allowed(key: str, value: Any, allowed: str) -> ConfigError:
    """The error for `key = value`, saying what to use instead (`allowed`)."""
    return ConfigError(f"{key} = {show(value)} is not allowed; use {allowed}")


def _describe(hint: Any, check: Check | None) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(show(a) for a in get_args(hint))
    words = {
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path string",
        bool: "true or false",
    }
    if get_origin(hint) is tuple:
        text = f"a list of {len(get_args(hint))} numbers"
    elif get_origin(hint) is types.UnionType:  # `X | None`: None means "not set"
        text = words[next(a for a in get_args(hint) if a is not type(None))]
    elif get_origin(hint) is Union:  # `int | Literal["auto"]`: a number, or a word for a default
        word, number = _word_or(hint)
        said = get_args(word)
        text = show(said[0]) if len(said) == 1 else f"{_describe(word, None)},"
        return f"{text} or {_describe(number, check)}"
    else:
        text = words[hint]
    return f"{text} {check[1]}" if check else text


def _coerce(key: str, value: Any, hint: Any, check: Check | None) -> Any:
    """Return `value` in its canonical Python type, or raise naming `key` and what is allowed."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:  # `int | Literal["auto"]`: the word as it is, else the number checked
        word, number = _word_or(hint)
        if isinstance(value, str) and value in get_args(word):
            return value
        try:
            return _coerce(key, value, number, check)
        except ConfigError:
            raise not_allowed(key, value, _describe(hint, check)) from None
    if origin is types.UnionType and value is None:
        return None
    if origin is types.UnionType:
        hint = next(a for a in args if a is not type(None))
    number = isinstance(value, int | float) and not isinstance(value, bool)
    items: list[Any] = []
    if origin is Literal:
        ok = isinstance(value, str) and value in args
    elif origin is tuple:
        ok = isinstance(value, list | tuple) and len(value) == len(args)
        ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        items = [float(v) for v in value] if ok else []
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not -_INT64 <= value < _INT64:  # TOML's integers are any size; SQLite's not
            raise not_allowed(key, value, f"an integer of at most {_INT64 - 1}")
    elif hint is float:
        ok, value = number, float(value) if number else value
        if ok and not math.isfinite(value):  # inf passes every range; no deadline, rate or
            # size means it, and NaN compares false to all: each said as what it is
            raise not_allowed(key, value, "a finite " + _describe(hint, check).removeprefix("a "))
    elif hint is Path:
        ok, value = isinstance(value, str | Path), Path(value) if isinstance(value, str) else value
    else:
        ok = isinstance(value, hint)
    if ok and check:
        ok = all(check[0](v) for v in items) if origin is tuple else check[0](value)
    if not ok:
        raise not_allowed(key, value, _describe(hint, check))
    return tuple(items) if origin is tuple else value


def _word_or(hint: Any) -> tuple[Any, Any]:
    """`(Literal[...], the other type)` of a union of a literal and a type."""
    word = next(a for a in get_args(hint) if get_origin(a) is Literal)
    return word, next(a for a in get_args(hint) if a is not word)


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # cheap enough: jobs are built rarely


class Section:
    """Shared validation: per-field type and range checks, then the section's own rules."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            key, hint = f"{self.section}.{f.name}", _hints(type(self))[f.name]
            value = _coerce(key, getattr(self, f.name), hint, f.metadata.get("check"))
            object.__setattr__(self, f.name, value)  # frozen: normalise in place once
        self._validate()

    def _validate(self) -> None:
        """Cross-field rules inside one section; override where needed."""


S = TypeVar("S", bound=Section)


def unknown_name(what: str, prefix: str, got: str, allowed: list[str]) -> ConfigError:
    """The error for an unknown key or section `got`: the closest allowed name offered first
    ("did you mean ..."), then every allowed one, each with `prefix` (`training.`)."""
    close = difflib.get_close_matches(got, allowed, n=1)  # on bare names: the prefix is shared
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    names = ", ".join(prefix + a for a in allowed)
    return ConfigError(f"unknown {what} {prefix}{got}; {hint}allowed: {names}")


def build_section(cls: type[S], table: Any) -> S:
    """Build a section from its TOML table: unknown and missing keys named, then `cls` checks."""
    if not isinstance(table, dict):
        raise not_allowed(cls.section, table, f"a [{cls.section}] table")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in table:
        if key not in names:
            raise unknown_name("key", f"{cls.section}.", key, names)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.default is MISSING and f.name not in table:
            allowed = _describe(_hints(cls)[f.name], f.metadata.get("check"))
            raise ConfigError(f"{cls.section}.{f.name} is required; use {allowed}")
    return cls(**table)
