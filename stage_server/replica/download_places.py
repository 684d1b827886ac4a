"""The places of `--max-state-downloads`: the state downloads a replica serves at once, and which
one gives its place when a new one finds them all taken (`DownloadPlaces`).

A download whose reader took nothing for `rpc_timeout_s` (after which its own client gives up,
`swarm.rpc.stage_client`) gives its place at once: a caller that stops reading without hanging up
must not keep a place from a joiner (issue 44, N7). So does one past the whole transfer's bound
its receiver keeps (`whole_state_s`): a reader that takes a chunk just inside every idle bound
kept its place for as long as it liked. And a named follower (a joiner or a standby: under a
scheduler, one its ticket names) takes the place of the newest download that named none: anyone
with the token could hold every place with such downloads, each restarted inside its whole
bound, and a joiner's copy is what a stage's pool waits for. The newest, for it has lost the
least, and the scheduler's own downloads (a checkpoint's, an export's: they name no follower
either) run long; one cut all the same goes to the stage's next replica, or its checkpoint waits
for the next (an export fails, said).

A download ended while its reader reads is told why at its next part (`ending`), and cancelled
(told nothing) if it reads none within `rpc_timeout_s`, or its snapshot would be held by a call
that never ends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["DownloadPlaces"]

log = logging.getLogger(__name__)

Task = asyncio.Task[Any]


class DownloadPlaces:
    """The downloads `peer` serves now, each by its call's task, on the loop's clock."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._served: dict[Task, tuple[float, float]] = {}  # -> (began, its reader last took)
        self._ending: dict[Task, str] = {}  # ended for another, and why: said at its next part
        self._anonymous: set[Task] = set()  # of those served: no follower named

    def __len__(self) -> int:
        """Snapshots being served now."""
        return len(self._served)

    def make_room(self, most: int, follower: str, stall_s: float, whole_s: float) -> None:
        """Places for a new download (by `follower`; "": none named) where all `most` are
        taken: from the stalled, those past `whole_s`, then, for a follower, the newest that
        named none (the module says why)."""
        if len(self) >= most:
            self._let_stalled_go(stall_s, whole_s)
        if len(self) >= most and follower:
            self._give_way(follower, stall_s)

    def taken(self, task: Task, named: bool) -> None:
        """`task`'s download takes a place (`named`: by a follower)."""
        now = asyncio.get_running_loop().time()
        self._served[task] = (now, now)
        if not named:
            self._anonymous.add(task)

    def heard(self, task: Task) -> None:
        """`task`'s reader took a part (or its snapshot is made): not stalled."""
        if task in self._served:
            self._served[task] = (self._served[task][0], asyncio.get_running_loop().time())

    def ending(self, task: Task) -> str | None:
        """Why `task`'s download was ended for another, if it was."""
        return self._ending.pop(task, None)

    def left(self, task: Task) -> None:
        """`task`'s download is over: its place is free."""
        self._served.pop(task, None)
        self._ending.pop(task, None)
        self._anonymous.discard(task)

    def _let_stalled_go(self, stall_s: float, whole_s: float) -> None:
        now = asyncio.get_running_loop().time()
        for task, (began, heard) in list(self._served.items()):
            if now - heard > stall_s:
                del self._served[task]  # its place is free now; its call ends as it is cancelled
                task.cancel()
                why = f"whose reader took nothing for {now - heard:.3g} s"
            elif now - began > whole_s:
                del self._served[task]  # its reader reads: told why at its next part
                why = f"still read after {now - began:.3g} s (its bound: {whole_s:.3g} s)"
                self._end(task, why, stall_s)
            else:
                continue
            log.info("%s: a state download %s ended for another", self.peer, why)

    def _give_way(self, follower: str, stall_s: float) -> None:
        anonymous = [task for task in self._served if task in self._anonymous]
        if not anonymous:
            return
        newest = max(anonymous, key=lambda task: self._served[task][0])
        del self._served[newest]  # its place is the follower's now
        self._end(newest, f"{follower[:64]} copies this replica", stall_s)
        log.info("%s: a state download ended for %s, which copies it", self.peer, follower[:64])

    def _end(self, task: Task, why: str, stall_s: float) -> None:
        self._ending[task] = why
        asyncio.get_running_loop().call_later(stall_s, task.cancel)
