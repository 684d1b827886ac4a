"""Text from others, as a terminal may print it (issue 64 item 10).

What peers name themselves and announce (their ids, their relays' addresses) and what messages
quote reaches an operator's screen: `swarm status`, `swarm watch`, `swarm doctor`. A control
character in it (an escape sequence that clears the screen or retitles the terminal, a newline
that draws a line of its own) is written out as its escape instead, by the one function every
command that prints such text uses.
"""

from __future__ import annotations

__all__ = ["quoted", "shown"]


def shown(text: str) -> str:
    """`text` with each unprintable character written as its escape (`\\x1b`, `\\n`)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def quoted(text: str) -> str:
    """`text` as another's words in a line of ours: in double quotes, its own quotes and
    backslashes escaped and each unprintable character written as its escape, so nothing in it
    ends the quote or starts a line."""
    return '"' + shown(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'
