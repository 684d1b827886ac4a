"""The suite's order for `make test`'s dealing (`tests.support.once.once_first`): the first asker
of a once-per-run fixture goes first, its other askers last, everything else as collected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from tests.support.once import once_first


@dataclass
class Item:
    name: str
    fixturenames: tuple[str, ...] = ()


def order(*items: Item) -> list[str]:
    chosen = once_first(cast(list[pytest.Item], list(items)), ("run", "smoke"))
    return [cast(Any, item).name for item in chosen]


def test_the_first_asker_leads_and_the_readers_trail() -> None:
    assert order(
        Item("a"),
        Item("b", ("tmp_path",)),
        Item("run1", ("run",)),
        Item("run2", ("run", "tmp_path")),
        Item("c"),
        Item("smoke1", ("smoke",)),
        Item("run3", ("run",)),
    ) == ["run1", "smoke1", "a", "b", "c", "run2", "run3"]


def test_an_asker_of_two_leads_unless_both_were_asked_for() -> None:
    assert order(
        Item("run1", ("run",)), Item("both", ("run", "smoke")), Item("again", ("smoke", "run"))
    ) == ["run1", "both", "again"]


def test_a_suite_without_askers_keeps_its_order() -> None:
    assert order(Item("a"), Item("b"), Item("c")) == ["a", "b", "c"]
