"""News for a job's status from the coordinator's parts (a rollback that waits, checkpoints not
written): said through the coordinator's `on_status`, whose failure (the status's store full
too, the bus away) is logged and never fails the job: it is news, not work."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

__all__ = ["OnStatus", "tell"]

log = logging.getLogger(__name__)

OnStatus = Callable[[str], Awaitable[None] | None]
"""What `swarm status` should say: the job's message and an event of its history."""


async def tell(on_status: OnStatus | None, text: str) -> None:
    """`on_status(text)`, awaited where it must be; a failure of it logged at WARNING."""
    if on_status is None:
        return
    try:
        said = on_status(text)
        if said is not None:
            await said
    except Exception as e:
        log.warning("not said in the job's status (%s): %s", e, text)
