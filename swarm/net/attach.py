"""STAND-IN for helper "relay"'s `swarm.net.attach` (issue 42): the contract's signature only, so
that the stage server imports on this branch; it attaches to nothing. The lead takes relay's real
module in its place at the merge."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Attachment"]


class Attachment:
    """Keeps a NAT'd peer attached to one relay of `relays()`; `on_change(relay or None)`."""

    def __init__(
        self,
        peer: str,
        token: str | None,
        local_address: str,
        relays: Callable[[], Sequence[str]],
        on_change: Callable[[str | None], None],
    ) -> None:
        self.peer, self.token, self.local_address = peer, token, local_address
        self.relays, self.on_change = relays, on_change

    @property
    def relay(self) -> str | None:
        return None

    async def start(self) -> None:
        raise NotImplementedError("swarm.net.attach is a stand-in on this branch")

    async def stop(self) -> None:
        pass
