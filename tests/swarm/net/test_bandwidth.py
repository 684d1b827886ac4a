"""`--bandwidth UP/DOWN` parsing (`swarm.net.bandwidth`): bits as tc writes them, bytes only spelt
out, and a clear error for what it cannot read or could read two ways."""

from __future__ import annotations

import argparse
import math

import pytest

from swarm.errors import ConfigError
from swarm.net.bandwidth import (
    MAX_LINK_BYTES_PER_SECOND,
    bandwidth_flag,
    format_rate,
    parse_bandwidth,
    parse_rate,
    plausible_rate,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100M/20M", (12.5e6, 2.5e6)),  # plain M: Mbit/s
        ("10M/100M", (1.25e6, 12.5e6)),
        ("100mbit/1gbit", (12.5e6, 125e6)),
        ("1Gbit", (125e6, 125e6)),  # one value: both directions
        ("500kbit / 2.5mbit", (62.5e3, 312.5e3)),
        ("8000000", (1e6, 1e6)),  # a bare number: bits/s
        ("1mibit/0", (2**20 / 8, 0.0)),  # IEC prefix; 0: measured
        ("12.5MB/s", (12.5e6, 12.5e6)),  # bytes, spelt out
        ("12.5MB/s/100mbit", (12.5e6, 12.5e6)),
    ],
)
def test_rates_read_as_tc_writes_them(text: str, expected: tuple[float, float]) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("100Mbps", "ambiguous"),  # tc: megabytes; most people: megabits
        ("100Mb", "ambiguous"),
        ("fast", "not a rate"),
        ("10M/20M/30M", "not a rate"),
        ("-5M", "not a rate"),
        ("10mb/s", "B/s"),
        ("", "not a rate"),
    ],
)
def test_what_it_cannot_read_is_refused_clearly(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_bandwidth(text)


def test_the_flag_shows_the_parsers_message_and_defaults_to_measured() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--bandwidth", default="", type=bandwidth_flag)
    assert p.parse_args([]).bandwidth == (0.0, 0.0)
    assert p.parse_args(["--bandwidth", "10M/100M"]).bandwidth == (1.25e6, 12.5e6)
    with pytest.raises(argparse.ArgumentError, match="ambiguous"):
        p.parse_args(["--bandwidth", "100Mbps"])


def test_rates_are_shown_in_bits() -> None:
    assert format_rate(1.25e6) == "10Mbit/s"
    assert format_rate(125e6) == "1Gbit/s"
    assert format_rate(0) == "?"
    assert parse_rate("10M") == 1.25e6


def test_a_rate_past_the_ceiling_is_refused_and_an_announced_one_not_believed() -> None:
    with pytest.raises(ConfigError, match="past 100Gbit/s"):
        parse_bandwidth("1tbit")
    assert plausible_rate(MAX_LINK_BYTES_PER_SECOND) == MAX_LINK_BYTES_PER_SECOND
    for bad in (math.nan, math.inf, -1.0, 1e12):
        assert plausible_rate(bad) == 0.0
