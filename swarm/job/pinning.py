"""A job's data pinned to its contents: the scheduler writes the data file's sha256 into the
stored spec at submit (`pin_data`), and whoever builds the job from that spec later (a remote
trainer, a restarted scheduler) refuses a file whose contents changed
(`swarm.job.config.verify_data`, run by every parse)."""

from __future__ import annotations

import itertools
import json
import math
import re
import tomllib
from collections.abc import Iterator
from typing import Any

from swarm.errors import ConfigError
from swarm.job.coerce import not_allowed

__all__ = ["pin", "pin_data"]


def pin_data(text: str, sha256: str) -> str:
    """Job TOML `text` with `data.sha256 = sha256` set, so whoever reads the spec later (a remote
    trainer, a restarted scheduler) refuses a data file whose contents changed."""
    return pin(text, "data", "sha256", sha256)


def pin(text: str, section: str, key: str, sha256: str | float) -> str:
    """Job TOML `text` with `section.key = sha256` set (a file's hash: the data's, or the initial
    checkpoint's `model.init_sha256`; or a number a scheduler sets, `scheduler.trusted_peers`).
    The text is kept as written (comments too) with one line added where TOML allows it; else
    it is written anew (e.g. the section as an inline table). Raises ConfigError if `text` pins
    another hash."""
    doc = tomllib.loads(text)
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise not_allowed(section, table, f"a [{section}] table")
    if table.get(key) == sha256:
        return text
    if key in table:
        raise not_allowed(f"{section}.{key}", table[key], f'the file\'s sha256 "{sha256}"')
    want = {**doc, section: {**table, key: sha256}}
    for candidate in _candidates(text, section, f"{key} = {_toml_value(sha256)}\n", want):
        try:
            if tomllib.loads(candidate) == want:
                return candidate
        except tomllib.TOMLDecodeError:
            continue
    raise ConfigError(
        f"cannot write {section}.{key} into this job file; add it to [{section}] by hand"
    )


# Lines that look like the section's header tried as the place for the new line, at most: a
# table has one header, and a look-alike is inside a multi-line string (a path may hold one).
# Each try is a copy of the spec and a parse of it, made as it is tried: a spec of 20,000
# look-alikes made 20,000 copies of itself before any was tried (4.8 GB for 240 kB).
_HEADER_TRIES = 4


def _candidates(text: str, section: str, line: str, want: dict[str, Any]) -> Iterator[str]:
    """`text` with `line` written where it may belong, most faithful first, each made as it is
    asked for: after the section's header, as a dotted key at the top, or the document anew."""
    lines = text.splitlines(keepends=True)
    header = re.compile(rf"\s*\[\s*{section}\s*\]\s*(#.*)?")
    heads = (i for i, row in enumerate(lines) if header.fullmatch(row.rstrip("\r\n")))
    for i in itertools.islice(heads, _HEADER_TRIES):  # after the section's header
        head = "".join(lines[: i + 1])
        head += "" if head.endswith("\n") else "\n"
        yield head + line + "".join(lines[i + 1 :])
    yield f"{section}.{line}{text}"  # dotted keys, or no such section yet
    yield _dump_toml(want)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):  # JSON's escapes are TOML's, but TOML also escapes DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} as TOML")


def _dump_toml(doc: dict[str, Any]) -> str:
    """A job document as TOML: top-level keys, then one table per section."""
    lines = [
        f"{_toml_key(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)
    ]
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"\n[{_toml_key(section)}]")
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
