"""The scheduler's own link to the broker, as the silence of its peers' load reports is judged.

Why: a member whose load reports stop for `--load-silence-s` is left out (hung, or cut off). But
when the scheduler's own link to the broker is down (an external Mosquitto restarted, the link
to it lost), every report stops at once: every replica of every stage was left out 10 s later,
the job read "stage k lost its last replica ... start a stage server" for each stage, and
training stopped, though the replicas computed on (the data plane is gRPC, not the broker).
While the link is down nobody's silence counts, and from its return each peer's is timed anew,
from when the peers can be back too (`PEERS_BACK_S`: a restarted broker's peers reconnect
after up to their own backoff): its reports come again within `load_silence_s`, or it is left
out then. (A link lost silently is noticed by the bus's keepalive, within 1.5 x 5 s: a silence
bound under that may still leave the replicas out before the loss is seen.) A replica that really
died meanwhile is left out by the calls to it that fail, as at any time."""

from __future__ import annotations

from collections.abc import Callable

from swarm.bus.api import BusSettings
from swarm.clock import Clock

__all__ = ["PEERS_BACK_S", "OwnLink"]

PEERS_BACK_S = BusSettings().reconnect_max_s  # a broker back: its peers' reports within this


class OwnLink:
    def __init__(self, clock: Clock, up: Callable[[], bool] = lambda: True) -> None:
        """`up()`: whether the link is up now (the bus's `connected`)."""
        self.clock, self._up = clock, up
        self._since: float | None = clock.now()

    def since(self) -> float | None:
        """When the link last came up, on `clock` (None: down now). Looked at lazily, at each
        judgement of a silence; an outage between two looks is missed, and it is shorter than
        the looks' pace (placement, membership and status look every few seconds)."""
        if not self._up():
            self._since = None
        elif self._since is None:
            # the peers reconnect too, each after up to its bus's `reconnect_max_s` of backoff
            self._since = self.clock.now() + PEERS_BACK_S
        return self._since
