"""What the scheduler's reachability check dials of a peer (`scheduler.reachability`): the
address it announced and the relay it named, if any. A change of either is checked again."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.proto import control_pb2 as cpb

__all__ = ["DialTarget"]


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]") or address


@dataclass(frozen=True, slots=True)
class DialTarget:
    """A peer's address and relay ("" for none), as one check dials them."""

    address: str
    relay: str

    @property
    def hosts(self) -> tuple[str, str]:
        """The hosts its check dials: its own, then its relay's."""
        return _host(self.address), _host(self.relay)

    def first_relay_after(
        self, old: DialTarget | None, last: cpb.ReachabilityReport | None
    ) -> bool:
        """Whether this names a relay for the very address `old` named alone, where the peer's
        last report (`last`) found that address unreachable: the peer attached to a relay on
        that report, and its relay is checked at once, once a peer id (`DialPace`)."""
        alone = DialTarget(self.address, "")
        return (
            bool(self.relay)
            and old == alone
            and last is not None
            and last.reachability == cpb.REACHABILITY_UNREACHABLE
            and DialTarget(last.address, last.relay) == alone
        )
