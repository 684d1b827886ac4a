"""Pinning a hash into a job's spec costs about the spec, whatever the spec holds
(`swarm.job.pinning`).

`pin` wrote the line after each line that looks like the section's header, and built every such
copy of the spec before trying any: a header-like line inside a multi-line string (a path may
hold anything TOML allows) made one copy each. A spec of 20,000 such lines (a path that
`realpath` resolves to a real file, `/../` steps over the made-up parts) took 20,000 copies of
itself, at submit, on the scheduler's event loop: a 1 MiB spec, tens of gigabytes."""

from __future__ import annotations

import tomllib
import tracemalloc

from swarm.job.pinning import pin_data

DIGEST = "ab" * 32


def test_header_like_lines_in_a_string_cost_no_copy_each() -> None:
    steps = "".join("\n[data]\n/../" for _ in range(20_000))
    text = f'[data]\nkind = "tokens"\npath = """/root{steps}"""\n'
    tracemalloc.start()
    try:
        pinned = pin_data(text, DIGEST)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    doc = tomllib.loads(pinned)
    assert (
        doc["data"]["sha256"] == DIGEST
        and doc["data"]["path"] == tomllib.loads(text)["data"]["path"]
    )
    assert peak < 20 * len(text), f"{peak} bytes at peak for a spec of {len(text)}"
