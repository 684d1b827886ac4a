"""Reachability measured, not assumed: the scheduler dials each peer's announced address back.

When a peer announces itself, or announces another address or relay, `ReachabilityChecker` dials
it back with a short authenticated call (`Dialer`; in production `scheduler.dial_back`'s
`StageDialer`: StageService.Info through `swarm.net.dial.channel`, with the swarm's token, a 2 s
deadline). The gRPC health check
would not do: it is open to anyone, so it would not show that the peer takes the swarm's calls.
The result is a `ReachabilityReport`:
- DIRECT: its announced address answered, as that peer;
- RELAYED: it announces a relay (`PeerAnnouncement.relay`; a peer behind NAT attaches to one by
  itself) and answered through it (`swarm.net.paths.relayed_address`), not directly;
- UNREACHABLE: nothing answered; `detail` is its cause and the dial's error, `remedy` what fixes
  that cause (`scheduler.dial_causes`: a TLS name mismatch, a wrong token, a relay down, ...).
  The peer, and status, are told a cause that says nothing of what listens at an address it
  named (`dial_causes.told`: "no answer" but for a TLS name mismatch and a private address not
  dialled); the scheduler's log keeps the whole. An address that is not public is not dialled
  unless the operator allows private ranges (`scheduler.dial_scope`); one peer's checks are
  `min_interval_s` apart at least (a first relay aside: `DialPace`), newcomers checked first
  (from both ends of their line in turn), at most `per_host` at once of the peers naming one
  host, and an unreachable peer's retries ever further apart (`retry_s` doubled up to `recheck_s`).
Each report goes to `on_report` (the registry keeps it: placement leaves an unreachable peer out,
and every call to a relayed one goes through its relay) and is retained on
`peers/{peer}/reachability`, where the peer reads it (its log shows the remedy); it is cleared
when the peer leaves.

The checks run off the event loop's critical path: `announced` only notes what to check, `run`
dials at most `concurrency` peers at once. Reachable peers are checked again every `recheck_s`;
unreachable ones after `retry_s`, then twice that, ... up to `recheck_s` (a peer that fixed its
router is found within that; one that announces anew, once the dial pace allows). A re-check
of a reachable peer that fails once is not believed at once: a stage server busy with a step may
miss a 2 s deadline, and dropping a serving replica for that would cost a step; only
`demote_after` failures in a row make it unreachable. A first check, or one of a changed address
or relay, counts at once.

Peers not yet checked (UNKNOWN) are not placed: the check takes at most `timeout_s`, less than
placement's grace period. Every peer can be checked: with the swarm's token on a closed swarm,
without one on an open one (which accepts calls without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

from scheduler import dial_causes
from scheduler.dial_causes import told, verdict
from scheduler.dial_scope import PACE_S, DialPace, DialScope
from scheduler.dial_target import DialTarget
from swarm.bus.api import BusLike
from swarm.net import paths
from swarm.proto import control_pb2 as cpb

__all__ = [
    "DialFailed",
    "Dialer",
    "ReachabilityChecker",
    "path_text",
    "remedy",
    "retained_on",
]

log = logging.getLogger(__name__)

#: `publish(peer, report)`: retain `report` on the peer's topic; None clears it (the peer left).
Publish = Callable[[str, cpb.ReachabilityReport | None], Awaitable[None]]


def retained_on(bus: BusLike) -> Publish:
    """`Publish` on `bus`: each report retained on `peers/{peer}/reachability`, cleared with an
    empty retained message."""

    async def publish(peer: str, report: cpb.ReachabilityReport | None) -> None:
        topic = bus.topics.reachability(peer)
        await bus.publish(topic, report if report is not None else b"", retain=True)

    return publish


class DialFailed(Exception):
    """Nothing answered the dial-back as the peer; the message says what happened instead."""


class Dialer(Protocol):
    """The dial-back's one call: a fake in unit tests, `StageDialer` in the scheduler."""

    async def answer(self, address: str, timeout_s: float) -> str:
        """The peer id that answers an authenticated call at dial address `address` (a stage
        server's or an aggregator's); `DialFailed` otherwise."""
        ...


def remedy(address: str) -> str:
    """What an operator does about a peer nobody can dial at `address`."""
    return dial_causes.remedy(dial_causes.Cause.NO_ANSWER, address)


def path_text(report: cpb.ReachabilityReport | None) -> str:
    """A report in a few words, for status and logs: direct, via RELAY, UNREACHABLE: remedy."""
    if report is None or report.reachability == cpb.REACHABILITY_UNKNOWN:
        return "not checked yet"
    if report.reachability == cpb.REACHABILITY_DIRECT:
        return "direct"
    if report.reachability == cpb.REACHABILITY_RELAYED:
        return f"via {report.relay}"
    return f"UNREACHABLE ({report.detail}): {report.remedy}"


def _both_ends(line: list[str], newest_first: bool) -> list[str]:
    """`line` (oldest first) taken from its two ends in turn: oldest, newest, second oldest,
    ... (newest first if `newest_first`)."""
    taken, low, high = [], 0, len(line) - 1
    newest = newest_first
    while low <= high:
        if newest:
            taken.append(line[high])
            high -= 1
        else:
            taken.append(line[low])
            low += 1
        newest = not newest
    return taken


class ReachabilityChecker:
    def __init__(
        self,
        dialer: Dialer,
        publish: Publish,
        on_report: Callable[[cpb.ReachabilityReport], None],
        *,
        timeout_s: float = 2.0,
        concurrency: int = 8,
        recheck_s: float = 60.0,
        retry_s: float = 10.0,
        demote_after: int = 3,
        now: Callable[[], float] = time.monotonic,
        scope: DialScope | None = None,
        min_interval_s: float = PACE_S,
        per_host: int = 2,
        pace_failures: bool = True,
    ) -> None:
        self.dialer, self.publish, self.on_report = dialer, publish, on_report
        self.timeout_s, self.recheck_s, self.retry_s = timeout_s, recheck_s, retry_s
        self.pace_failures = pace_failures  # a failed dial said no sooner than a silent one's
        self.demote_after = demote_after
        self._now = now
        self.scope = scope or DialScope()  # public hosts only, unless the operator allows more
        self._pace = DialPace(min_interval_s)  # a peer's checks are this far apart at least
        self._concurrency = concurrency  # checks at once
        self._newest_next = False  # which end of the newcomers' line the next slot takes
        self._failed: dict[str, int] = {}  # checks in a row that found the peer unreachable
        # Checks dialling the same hosts at once: a host of silent ports holds at most this many
        # of the slots, whatever number of peers name it (issue 54, Low: 200 fake peers at one
        # silent host held every slot, and an honest newcomer waited behind them all).
        self._per_host = per_host
        self._dialling: Counter[tuple[str, str]] = Counter()
        self._targets: dict[str, DialTarget] = {}
        self._due: dict[str, float] = {}  # peer -> when it is checked next (`now`'s clock)
        self._misses: dict[str, int] = {}  # failed re-checks in a row of a reachable peer
        self._unwarned: set[str] = set()  # first found unreachable, said at INFO only
        self.reports: dict[str, cpb.ReachabilityReport] = {}
        self._checking: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    # -- what arrives (on the event loop; never waits) -------------------------------------------
    def announced(self, message: cpb.PeerAnnouncement) -> None:
        """A peer's announcement: a new peer is checked at once, a new address or relay as soon
        as the dial pace allows (`DialPace`)."""
        peer = message.peer
        if not peer:
            return
        if message.state == cpb.PEER_STATE_OFFLINE:
            self.left(peer)
            return
        if not message.address:
            return  # nothing to dial (a relay that serves calls at its relay listener only)
        target = DialTarget(message.address, message.relay)
        old = self._targets.get(peer)
        if old == target:
            return  # the same again, as every few seconds: its re-checks are timed
        if old is not None and message.relay:
            log.info("peer %s is reached through relay %s now: checking it", peer, message.relay)
        first_relay = target.first_relay_after(old, self.reports.get(peer))
        self._targets[peer] = target
        self._due[peer] = self._pace.earliest(peer, self._now(), first_relay=first_relay)
        self._misses.pop(peer, None)
        self._failed.pop(peer, None)
        self._wake.set()

    def left(self, peer: str) -> None:
        """`peer` left: forget it, and clear its retained report. Cleared even when not known
        here: a peer that left while the scheduler was down is known by its retained last-will
        only, and its report of before would stay retained (clearing nothing is nothing)."""
        self._targets.pop(peer, None)
        self._due.pop(peer, None)
        self._misses.pop(peer, None)
        self._failed.pop(peer, None)
        self._unwarned.discard(peer)
        self._pace.forget(peer)
        self.reports.pop(peer, None)
        self._spawn(self._clear(peer))

    # -- the checks ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Check peers as they come due, until cancelled."""
        try:
            while True:
                wait = self._start_due(self._now())
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation
                # that comes as the wake does (a check ending), and this loop ran on.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            for task in list(self._background):
                task.cancel()

    def _start_due(self, now: float) -> float | None:
        """Start the checks that are due, while a slot is free; how long until the next is.

        Who goes first is chosen when a slot frees, not queued when a peer comes due (a check
        queued behind 200 would wait for them all): newcomers (never checked: not placed until
        they are) before re-checks; of hosts dialled `per_host` times at once, none; then the
        peers of hosts dialled least. Newcomers are taken from both ends of their line in turn,
        the longest waiting and the latest come (`_both_ends`): a burst of made-up peers
        announced before an honest one delays it by one check, not by their number, and a
        stream of made-up peers announced without end cannot starve one that came before them.
        Peer ids are free to make up with the swarm's token (one credential for every peer), so
        no rule by announcer can bound this better (docs/decisions.md)."""
        waiting = [p for p in self._due if p not in self._checking]
        fresh = _both_ends(
            sorted((p for p in waiting if p not in self.reports), key=self._due.__getitem__),
            self._newest_next,
        )
        known = sorted((p for p in waiting if p in self.reports), key=self._due.__getitem__)
        later = []
        for peer in sorted(fresh, key=self._dialled) + sorted(known, key=self._dialled):
            hosts = self._targets[peer].hosts
            if self._due[peer] > now:
                later.append(self._due[peer])
            elif len(self._checking) < self._concurrency and self._dialling[hosts] < self._per_host:
                self._dialling[hosts] += 1
                self._newest_next ^= peer not in self.reports
                self._checking[peer] = self._spawn(self._check(peer, self._targets[peer]))
        return max(0.05, min(later) - now) if later else None

    def _dialled(self, peer: str) -> int:
        return self._dialling[self._targets[peer].hosts]

    async def _check(self, peer: str, target: DialTarget) -> None:
        try:
            await self._checked(peer, target)
        finally:
            self._dialling[target.hosts] -= 1
            if not self._dialling[target.hosts]:
                del self._dialling[target.hosts]
            self._checking.pop(peer, None)
            self._wake.set()

    async def _checked(self, peer: str, target: DialTarget) -> None:
        self._pace.began(peer, self._now())
        report = await self.measure(peer, target.address, target.relay)
        if self._targets.get(peer) != target:
            return  # it left, or moved, meanwhile: that is checked anew
        old = self.reports.get(peer)
        reachable = old is not None and old.reachability in (
            cpb.REACHABILITY_DIRECT,
            cpb.REACHABILITY_RELAYED,
        )
        if report.reachability == cpb.REACHABILITY_UNREACHABLE and reachable:
            misses = self._misses.get(peer, 0) + 1
            if misses < self.demote_after:  # one slow answer does not drop a replica
                self._misses[peer] = misses
                self._due[peer] = self._now() + min(self.retry_s, self.recheck_s)
                log.info("peer %s missed a dial-back (%s); trying again", peer, report.detail)
                return
        self._misses.pop(peer, None)
        self._due[peer] = self._now() + self._next_in(peer, report)
        if old is not None and _same(old, report):
            if peer in self._unwarned:  # said at INFO as a start behind NAT; still so: trouble
                self._unwarned.discard(peer)
                self._warn(report)
            return  # nothing new to say
        self.reports[peer] = report
        self._said(report, first=old is None)  # the whole, in the scheduler's own log
        told_report = _told(report)
        self.on_report(told_report)  # status shows it to every token holder
        await self.publish(peer, told_report)

    def _next_in(self, peer: str, report: cpb.ReachabilityReport) -> float:
        """Seconds to `peer`'s next check: `recheck_s` when reachable; when not, `retry_s`,
        doubled at each failure in a row up to `recheck_s` (or `retry_s` if longer): a peer id
        parked at a silent address costs the dial-back ever less of its slots."""
        if report.reachability != cpb.REACHABILITY_UNREACHABLE:
            self._failed.pop(peer, None)
            return self.recheck_s
        failed = self._failed[peer] = min(self._failed.get(peer, 0) + 1, 32)
        return min(self.retry_s * 2 ** (failed - 1), max(self.recheck_s, self.retry_s))

    async def _paced(self, peer: str, address: str) -> str | None:
        """`_dial`, a failure said no sooner than `timeout_s` after it began (issue 64, item 6):
        a closed port answered in 0.01 s and a silent one in 2 s, so the report's timing told
        the peer which ports the scheduler's network holds open."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        failed = await self._dial(peer, address)
        if failed is not None and self.pace_failures:
            await asyncio.sleep(max(0.0, began + self.timeout_s - loop.time()))
        return failed

    async def measure(self, peer: str, address: str, relay: str) -> cpb.ReachabilityReport:
        """Dial `peer` at `address`, then (if it announces one) through `relay`."""
        report = cpb.ReachabilityReport(peer=peer, address=address, time=time.time())
        direct = await self.scope.refuses(address) or await self._paced(peer, address)
        if direct is None:
            report.reachability = cpb.REACHABILITY_DIRECT
            return report
        through = None
        if relay:
            # none written for what it announced ('@' or '/' in its id or relay): said as the
            # relay path's failure, where it raised out of the check, logged as a bug each time
            relayed = paths.relayable(peer, address, relay)
            through = await self.scope.refuses(relay) or (
                await self._paced(peer, relayed)
                if relayed is not None
                else f"no relayed address for peer id {peer!r} through {relay!r}"
            )
            if through is None:
                report.reachability, report.relay = cpb.REACHABILITY_RELAYED, relay
                report.detail = f"direct: {direct}"
                return report
        _, detail, fix = verdict(address, direct, relay, through, peer)
        report.reachability, report.detail, report.remedy = (
            cpb.REACHABILITY_UNREACHABLE,
            detail,
            fix,
        )
        # The relay it was dialled through too: the peer tells a verdict on its relay path from
        # one on the address it announced before it attached (issue 68 item 4).
        report.relay = relay
        return report

    async def _dial(self, peer: str, address: str) -> str | None:
        """None when `address` answers as `peer`; else what happened, in words."""
        try:
            async with asyncio.timeout(self.timeout_s + 1.0):  # a dialer that forgets its own
                answered = await self.dialer.answer(address, self.timeout_s)
        except DialFailed as e:
            return str(e)
        except TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except Exception as e:  # a malformed address, say: the peer is at fault, not the check
            return f"{type(e).__name__}: {e}"
        if answered != peer:
            return f"{address} answers as peer {answered!r}, not {peer!r}"
        return None

    async def _clear(self, peer: str) -> None:
        await self.publish(peer, None)

    def _said(self, report: cpb.ReachabilityReport, first: bool) -> None:
        starting = report.detail.startswith(dial_causes.Cause.NOT_DIALLED.value)
        if (
            report.reachability == cpb.REACHABILITY_UNREACHABLE
            and first
            and starting
            and not report.relay
        ):
            # A peer's first check, at a private address not dialled and no relay announced
            # yet: the usual start behind NAT (it attaches to a relay next, and is checked
            # there). Trouble only if it stays so: the next check that fails says so at WARNING
            # (issue 68 item 4). An address that was dialled and did not answer is trouble now.
            log.info(
                "peer %s is not reachable directly (%s): checked again in %.0f s, or through "
                "a relay as soon as it announces one",
                report.peer,
                report.detail,
                self._due.get(report.peer, self._now()) - self._now(),
            )
            self._unwarned.add(report.peer)
        elif report.reachability == cpb.REACHABILITY_UNREACHABLE:
            self._warn(report)
        else:
            self._unwarned.discard(report.peer)
            log.info("peer %s at %s: %s", report.peer, report.address, path_text(report))

    def _warn(self, report: cpb.ReachabilityReport) -> None:
        self._unwarned.discard(report.peer)
        log.warning("peer %s is unreachable (%s): %s", report.peer, report.detail, report.remedy)

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(_logged(work))
        self._background.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)
        return task


async def _logged(work: Awaitable[None]) -> None:
    """A check or a clearing in the background: its failure (the bus gone) is logged, not lost."""
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("reachability: a check failed")


def _told(report: cpb.ReachabilityReport) -> cpb.ReachabilityReport:
    """The report as the peer reads it, and status shows it: the cause in words (or "no
    answer"), not the dial's error text (`dial_causes.told`)."""
    told_report = cpb.ReachabilityReport()
    told_report.CopyFrom(report)
    relayed = report.reachability == cpb.REACHABILITY_RELAYED
    target = report.address, report.relay
    told_report.detail, told_report.remedy = told(report.detail, report.remedy, *target, relayed)
    return told_report


def _same(a: cpb.ReachabilityReport, b: cpb.ReachabilityReport) -> bool:
    return (a.reachability, a.address, a.relay, a.detail) == (
        b.reachability,
        b.address,
        b.relay,
        b.detail,
    )
