"""Telling that another process logs in with this bus's client id.

A broker keeps one connection per client id: a second login drops the first (MQTT 3.1.1 says so
and tells the dropped client nothing; Mosquitto and amqtt both do it). Two processes with one id
(a second `swarm relay` or stage server started with the id of one that runs) therefore kick each
other off for ever, each reconnect dropping the other, a few times a second. What a client sees
is its own part of it: connections the broker accepted at once and dropped within moments, in a
row. A broker that restarts refuses connections for a while instead (which ends the count), and a
network that drops a connection does not drop the next one again within a second or two.
"""

from __future__ import annotations

from swarm.bus.api import BusSettings, BusTakenOver

__all__ = ["DEFAULT_REMEDY", "TakeoverWatch"]

DEFAULT_REMEDY = "stop the other process, or give this one an id of its own"


class TakeoverWatch:
    """Counts connections in a row the broker dropped right after accepting them; `lost` says
    when the count means a takeover (`BusSettings.takeover_after`)."""

    def __init__(self, settings: BusSettings) -> None:
        self.settings = settings
        self.dropped = 0  # in a row, each within takeover_window_s of being accepted

    def refused(self) -> None:
        """A connect attempt failed: the broker is away, not taken by another of us."""
        self.dropped = 0

    def lost(self, lived_s: float) -> bool:
        """A connection the broker accepted was dropped after `lived_s`: whether that makes it a
        takeover."""
        self.dropped = self.dropped + 1 if lived_s < self.settings.takeover_window_s else 0
        return self.dropped >= self.settings.takeover_after

    def error(self, client_id: str, url: str, remedy: str) -> BusTakenOver:
        return BusTakenOver(
            f"another process is connected to the broker at {url} as {client_id!r}: the broker "
            f"dropped this connection {self.dropped} times in a row, each within "
            f"{self.settings.takeover_window_s:g} s of accepting it (a broker keeps one "
            f"connection per client id, so the two would kick each other off for ever); "
            f"{remedy}"
        )
