"""Telling that another process logs in with this bus's client id.

A broker keeps one connection per client id: a second login drops the first (MQTT 3.1.1 says so
and tells the dropped client nothing; Mosquitto and amqtt both do it). Two processes with one id
(a second `swarm relay` or stage server started with the id of one that runs) therefore kick each
other off for ever, each reconnect dropping the other, a few times a second. What a client sees
is its own part of it: connections the broker accepted at once and dropped within moments, in a
row. A broker that restarts refuses connections for a while instead (which ends the count), and a
network that drops a connection does not drop the next one again within a second or two.

Which of the two gives way: the one that never held the id for long (started second), so a
relay that has served for hours is not stopped by a mistaken second one. The one that held it
keeps reconnecting and says so, in case the other runs a swarm from before this check.
"""

from __future__ import annotations

import enum

from swarm.bus.api import BusSettings, BusTakenOver

__all__ = ["DEFAULT_REMEDY", "KEEPS", "Takeover", "TakeoverWatch"]

DEFAULT_REMEDY = "stop the other process, or give this one an id of its own"


class TakeoverWatch:
    """Counts connections in a row the broker dropped right after accepting them. `lost` says
    when the count means a takeover, and which of the two gives way: the newcomer, which never
    held the id for long (the one that did, `settled`, keeps it and says so now and then).
    Failing to reach the broker ends a count: a broker away is no twin."""

    def __init__(self, settings: BusSettings) -> None:
        self.settings = settings
        self.dropped = 0  # in a row, each within takeover_window_s of being accepted
        self.settled = False  # a connection of this client lasted past takeover_window_s

    def refused(self) -> None:
        """A connect attempt failed: the broker is away, not taken by another of us."""
        self.dropped = 0

    def lost(self, lived_s: float) -> Takeover | None:
        """A connection the broker accepted was dropped after `lived_s`: a takeover to give way
        to (GIVE_UP), one to say (SAY: at `takeover_after` drops in a row, twice as many, ...),
        or None."""
        if lived_s >= self.settings.takeover_window_s:
            self.settled, self.dropped = True, 0
            return None
        self.dropped += 1
        times, after = divmod(self.dropped, self.settings.takeover_after)
        if after or times & (times - 1):
            return None
        return Takeover.SAY if self.settled else Takeover.GIVE_UP

    def error(self, client_id: str, url: str, remedy: str) -> BusTakenOver:
        return BusTakenOver(
            f"another process is connected to the broker at {url} as {client_id!r}: the broker "
            f"dropped this connection {self.dropped} times in a row, each within "
            f"{self.settings.takeover_window_s:g} s of accepting it (a broker keeps one "
            f"connection per client id, so the two would kick each other off for ever); "
            f"{remedy}"
        )


class Takeover(enum.Enum):
    GIVE_UP = "give up"  # this process came second: it stops, saying why
    SAY = "say"  # this one held the id first: it keeps it, and says the other takes turns


KEEPS = (
    "this process held the id first and keeps it (the other stops by itself if it runs this "
    "swarm; else stop it)"
)
