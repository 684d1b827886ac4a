"""How many parts a job file's keys may have, checked before the TOML parser sees the text.

Python's parser (`tomllib`) spends time on a dotted key in proportion to its parts squared, and
on every key under a table header in proportion to the header's parts: a 40 KB line of one key
20,000 parts deep took it 6 s, and 1 MiB (a job file's bound, `MAX_SPEC_BYTES`) of such text
hours, all of it holding the scheduler's event loop (SubmitJob parses on it). No job's key has
more than a few parts (`[model]`, `training.stages`), so a key or a table header of more than
`MAX_KEY_PARTS` is refused. The check reads only what decides where keys are, at the regex
engine's pace: strings and comments are blanked (their dots are no key's), then each line's key
(up to its `=`) or table header (up to its `]`) has its dots counted."""

from __future__ import annotations

import re

from swarm.errors import ConfigError

__all__ = ["MAX_KEY_PARTS", "check_key_depth"]

MAX_KEY_PARTS = 32  #: parts of one key or table header at most (`a.b.c` has 3)

# TOML's strings (multi-line first) and comments: what `_blanked` empties, newlines kept
_NOT_KEYS = re.compile(
    # (each as a run of plain characters between escapes and quotes: the engine's fast path)
    r'"""[^"\\]*(?:(?:\\[\s\S]|"(?!""))[^"\\]*)*"""'  # a multi-line basic string
    r"|'''[\s\S]*?'''"  # a multi-line literal string
    r'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # a basic string
    r"|'[^'\n]*'"  # a literal string
    r"|#[^\n]*"  # a comment
)


def check_key_depth(text: str, source: str = "the job file") -> None:
    """Refuse `text` where a key or a table header has more than MAX_KEY_PARTS parts."""
    for number, row in enumerate(_blanked(text).split("\n"), start=1):
        row = row.lstrip()
        end = row.find("]") if row.startswith("[") else row.find("=")
        if end < 0:
            continue  # no key here: a line of an array's values, or a blank one
        parts = row.count(".", 0, end) + 1
        if parts > MAX_KEY_PARTS:
            raise ConfigError(
                f"{source}, line {number}: a key of {parts} parts, over the {MAX_KEY_PARTS} "
                "(swarm's MAX_KEY_PARTS) a job file's keys and table headers may have"
            )


def _blanked(text: str) -> str:
    """`text` with each string and comment replaced by `""` and the newlines it spanned."""
    return _NOT_KEYS.sub(lambda m: '""' + "\n" * m.group().count("\n"), text)
