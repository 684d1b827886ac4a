"""`--bandwidth UP/DOWN`: a peer's link rates as an operator states them, in bits per second as
`tc` writes rates ("100mbit", "1gbit", "10M" meaning 10 Mbit/s), turned into the bytes per second
a peer announces (`PeerAnnouncement.upload_bytes_per_second`, `download_bytes_per_second`).

One value ("100M") is both directions; 0 in a direction leaves that direction measured
(`stage_server.peer.links`). Bytes are spelt out ("12.5MB/s"); tc's own bytes units ("mbps") are
refused, not guessed: "100Mbps" means megabits to most people and megabytes to tc, and a rate read
8 times off is worse than an error."""

from __future__ import annotations

import argparse
import logging
import math
import re

from swarm.errors import ConfigError
from swarm.proto import control_pb2 as cpb

__all__ = [
    "MAX_LINK_BYTES_PER_SECOND",
    "bandwidth_flag",
    "format_rate",
    "parse_bandwidth",
    "parse_rate",
    "plausible_rate",
    "plausible_rates",
]

log = logging.getLogger(__name__)

# The fastest link rate a peer may announce: 100 Gbit/s, a datacenter NIC's, ten times a fast
# home or office link's. Announcements are believed only up to here (`plausible_rate`): a rate
# past it is a mistake or an attack (1e12 B/s took every pool's parts; 1.7e308 overflowed them).
MAX_LINK_BYTES_PER_SECOND = 100e9 / 8

# SI prefixes as tc reads them (k = 1000), and IEC ones (ki = 1024).
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PREFIX |= {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_RATE = re.compile(r"(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<prefix>[kmgt]i?)?(?P<unit>bit|b/s|bps|b)?")
_SEPARATOR = re.compile(r"/(?!\s*s\s*(?:/|$))", re.IGNORECASE)
_FORM = (
    "UP/DOWN (or one rate for both) like 100mbit/20mbit, 1gbit, 10M/100M (Mbit/s), 500kbit "
    "or 12.5MB/s (bytes)"
)


def parse_rate(text: str) -> float:
    """Bytes per second of one rate: bits by default ("100mbit", "100M", "100000000"), bytes
    when written "B/s" ("12.5MB/s")."""
    raw = text.strip()
    match = _RATE.fullmatch(raw.lower())
    if match is None:
        raise ConfigError(f"--bandwidth: {text!r} is not a rate: write {_FORM}")
    unit = match["unit"] or "bit"
    if unit in ("bps", "b"):
        raise ConfigError(
            f"--bandwidth: {text!r} is ambiguous (bits or bytes?): write "
            f"{match['n']}{match['prefix'] or ''}bit for bits per second, or "
            f"{match['n']}{(match['prefix'] or '').upper()}B/s for bytes"
        )
    if unit == "b/s" and "B" not in raw:  # "mb/s": the b must say bytes, as B does
        raise ConfigError(f"--bandwidth: {text!r}: write B/s (bytes per second) or bit")
    value = float(match["n"]) * _PREFIX[match["prefix"] or ""]
    return value if unit == "b/s" else value / 8


def parse_bandwidth(text: str) -> tuple[float, float]:
    """`UP/DOWN` (or one rate for both) as (upload, download) bytes per second; 0 in a direction
    means "measure it"."""
    parts = _SEPARATOR.split(text)  # not the slash of "B/s"
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ConfigError(f"--bandwidth: {text!r} is not a rate: write {_FORM}")
    up, down = parse_rate(parts[0]), parse_rate(parts[1])
    if max(up, down) > MAX_LINK_BYTES_PER_SECOND:
        raise ConfigError(
            f"--bandwidth: {text!r} is past {format_rate(MAX_LINK_BYTES_PER_SECOND)}, the most a "
            "scheduler believes: give the link's real rate"
        )
    return up, down


def plausible_rate(value: float) -> float:
    """An announced link rate (bytes/s) as the scheduler takes it: 0 (not known) unless finite,
    positive and at most `MAX_LINK_BYTES_PER_SECOND`."""
    return value if math.isfinite(value) and 0.0 < value <= MAX_LINK_BYTES_PER_SECOND else 0.0


def plausible_rates(message: cpb.PeerAnnouncement, warned: set[str]) -> cpb.PeerAnnouncement:
    """`message` with its link rates `plausible_rate`: itself when both already are, else a copy
    (logged once per peer: `warned`, the peers already logged). Validated where an announcement
    enters the scheduler, since every pool's parts are sized by them."""
    up, down = message.upload_bytes_per_second, message.download_bytes_per_second
    if (plausible_rate(up), plausible_rate(down)) == (max(up, 0.0), max(down, 0.0)):
        return message
    if message.peer not in warned:
        warned.add(message.peer)
        log.warning(
            "peer %s announced link rates %r/%r B/s: not finite or past %s, taken as unknown",
            message.peer,
            up,
            down,
            format_rate(MAX_LINK_BYTES_PER_SECOND),
        )
    kept = cpb.PeerAnnouncement()
    kept.CopyFrom(message)
    kept.upload_bytes_per_second = plausible_rate(up)
    kept.download_bytes_per_second = plausible_rate(down)
    return kept


def bandwidth_flag(text: str) -> tuple[float, float]:
    """`parse_bandwidth` as an argparse `type`: its message shown as the flag's error; "" (the
    flag's default) is both measured."""
    if not text.strip():
        return 0.0, 0.0
    try:
        return parse_bandwidth(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def format_rate(bytes_per_second: float) -> str:
    """A rate for people, in bits per second as it was given ("10Mbit/s"); "?" when unknown."""
    if bytes_per_second <= 0:
        return "?"
    bits = bytes_per_second * 8
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g}{prefix}bit/s"
    return f"{bits:.3g}bit/s"
