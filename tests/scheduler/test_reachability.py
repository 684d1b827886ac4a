"""The scheduler's dial-back (`scheduler.reachability`), with a fake dialer behind its `Dialer`
seam: what it reports for each answer, when it dials, and how many at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from scheduler.dial_scope import NOT_DIALLED, DialScope
from scheduler.reachability import DialFailed, ReachabilityChecker, path_text
from swarm.net import paths
from swarm.proto import control_pb2 as cpb
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class FakeDialer:
    """Answers per dial address: a peer id, or a `DialFailed` text; unknown addresses refuse."""

    def __init__(self, answers: dict[str, str | DialFailed] | None = None) -> None:
        self.answers = dict(answers or {})
        self.calls: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.hold: asyncio.Event | None = None  # set: dials wait for it

    async def answer(self, address: str, timeout_s: float) -> str:
        self.calls.append(address)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                await self.hold.wait()
            answer = self.answers.get(address, DialFailed("UNAVAILABLE: Connection refused"))
            if isinstance(answer, DialFailed):
                raise answer
            return answer
        finally:
            self.in_flight -= 1


class Checked:
    """A checker over a `FakeDialer`, with what it published and reported."""

    def __init__(self, dialer: FakeDialer, **kwargs: Any) -> None:
        self.published: list[tuple[str, cpb.ReachabilityReport | None]] = []
        self.reported: asyncio.Queue[cpb.ReachabilityReport] = asyncio.Queue()
        self.dialer = dialer
        self.dials_at: list[int] = []  # the dials made when each report came
        # The fake's addresses are private ones, re-checked at once (`test_dial_scope`: not so),
        # and a failure reported as it comes (`test_a_failed_dial_is_said_as_late_as_a_silent_one`:
        # not so).
        defaults: dict[str, Any] = {
            "scope": DialScope(allow_private=True),
            "min_interval_s": 0.0,
            "pace_failures": False,
        }
        kwargs = defaults | kwargs
        self.checker = ReachabilityChecker(dialer, self._publish, self._reported, **kwargs)

    def _reported(self, report: cpb.ReachabilityReport) -> None:
        self.dials_at.append(len(self.dialer.calls))
        # The scheduler's own report, whole (its log's); status and the peer get the cause
        # only (`test_dial_back_ports`).
        self.reported.put_nowait(self.checker.reports[report.peer])

    async def _publish(self, peer: str, report: cpb.ReachabilityReport | None) -> None:
        self.published.append((peer, report))

    async def report(self) -> cpb.ReachabilityReport:
        return await asyncio.wait_for(self.reported.get(), 10)


@contextlib.asynccontextmanager
async def checking(dialer: FakeDialer, **kwargs: Any) -> AsyncIterator[Checked]:
    checked = Checked(dialer, **kwargs)
    task = asyncio.create_task(checked.checker.run())
    try:
        yield checked
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def announce(peer: str, address: str, relay: str = "", speed: float = 0.0) -> cpb.PeerAnnouncement:
    return cpb.PeerAnnouncement(
        peer=peer,
        address=address,
        relay=relay,
        state=cpb.PEER_STATE_JOINING,
        samples_per_second={0: speed},
    )


async def test_a_peer_that_answers_at_its_address_is_direct_and_its_report_is_published() -> None:
    async with checking(FakeDialer({"10.0.0.1:5000": "a"})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_DIRECT
        assert (report.peer, report.address) == ("a", "10.0.0.1:5000")
        assert c.published == [("a", report)]
        assert path_text(report) == "direct"


async def test_a_peer_nobody_can_dial_is_unreachable_with_the_error_and_the_flags_that_fix_it() -> (
    None
):
    async with checking(FakeDialer()) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "Connection refused" in report.detail
        for flag in ("--announce-host", "forward port 5000", "swarm relay", "--relay"):
            assert flag in report.remedy, flag
        assert path_text(report).startswith(
            "UNREACHABLE (no answer: UNAVAILABLE: Connection refused)"
        )


async def test_a_peer_behind_nat_that_announces_a_relay_is_relayed_through_it() -> None:
    via = paths.relayed_address("a", "192.168.1.20:5000", "relay.example:7000")
    async with checking(FakeDialer({via: "a"})) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000", relay="relay.example:7000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_RELAYED
        assert report.relay == "relay.example:7000"
        assert c.dialer.calls == ["192.168.1.20:5000", via]  # directly first, then the relay
        assert path_text(report) == "via relay.example:7000"


async def test_a_relay_that_does_not_carry_the_call_leaves_the_peer_unreachable() -> None:
    async with checking(FakeDialer()) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000", relay="relay.example:7000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "through relay relay.example:7000" in report.detail


async def test_a_peer_id_no_relayed_address_can_name_is_unreachable_through_its_relay() -> None:
    """'@' in the announced peer id: no relayed address can be written for it. The check raised
    out (a traceback logged each time the peer announced, and no report); it is the relay
    path's failure, said."""
    async with checking(FakeDialer()) as c:
        c.checker.announced(announce("a@b", "192.168.1.20:5000", relay="relay.example:7000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "no relayed address for peer id 'a@b'" in report.detail, report.detail


async def test_another_peer_answering_at_the_address_is_not_the_peer() -> None:
    async with checking(FakeDialer({"10.0.0.1:5000": "b"})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "answers as peer 'b'" in report.detail


async def test_a_peer_with_another_token_is_told_about_the_token() -> None:
    refused = DialFailed("UNAUTHENTICATED: wrong token; this swarm needs its token")
    async with checking(FakeDialer({"10.0.0.1:5000": refused})) as c:
        c.checker.announced(announce("a", "10.0.0.1:5000"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "token" in report.remedy


async def test_announcements_repeated_are_not_dialled_again_but_a_new_address_or_relay_is() -> None:
    dialer = FakeDialer({"h:1": "a", "h:2": "a"})
    async with checking(dialer, recheck_s=3600) as c:
        c.checker.announced(announce("a", "h:1"))
        await c.report()
        for _ in range(5):
            c.checker.announced(announce("a", "h:1", speed=1.0))
        c.checker.announced(announce("a", "h:2"))
        report = await c.report()
        assert report.address == "h:2"
        assert dialer.calls == ["h:1", "h:2"]
        c.checker.announced(announce("a", "h:2", relay="r:9"))  # attached to a relay: checked
        await asyncio.sleep(0)
        for _ in range(100):
            if len(dialer.calls) == 3:
                break
            await asyncio.sleep(0.01)
        assert dialer.calls[2] == "h:2"


async def test_a_peer_that_leaves_has_its_report_cleared() -> None:
    async with checking(FakeDialer({"h:1": "a"})) as c:
        c.checker.announced(announce("a", "h:1"))
        await c.report()
        c.checker.announced(cpb.PeerAnnouncement(peer="a", state=cpb.PEER_STATE_OFFLINE))
        for _ in range(100):
            if len(c.published) == 2:
                break
            await asyncio.sleep(0.01)
        assert c.published[-1] == ("a", None)
        assert "a" not in c.checker.reports


async def test_checks_run_at_most_concurrency_at_once_and_do_not_hold_up_announcements() -> None:
    # (each on a host of its own: `per_host` bounds the checks of one host at once)
    dialer = FakeDialer({f"h{i}:5": f"p{i}" for i in range(20)})
    dialer.hold = asyncio.Event()
    async with checking(dialer, concurrency=3) as c:
        for i in range(20):
            c.checker.announced(announce(f"p{i}", f"h{i}:5"))  # returns at once: nothing dialled
        for _ in range(100):
            if dialer.in_flight == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert dialer.in_flight == 3
        dialer.hold.set()
        reports = [await c.report() for _ in range(20)]
        assert {r.peer for r in reports} == {f"p{i}" for i in range(20)}
        assert dialer.most_in_flight == 3


async def test_a_reachable_peer_missing_one_recheck_stays_until_it_misses_several() -> None:
    dialer = FakeDialer({"h:1": "a"})
    async with checking(dialer, recheck_s=0.05, retry_s=0.05, demote_after=3) as c:
        c.checker.announced(announce("a", "h:1"))
        assert (await c.report()).reachability == cpb.REACHABILITY_DIRECT
        del dialer.answers["h:1"]  # it stops answering
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert c.dials_at[-1] == 4  # the first check, then three misses in a row (not one)
        dialer.answers["h:1"] = "a"  # back: found again at its next retry
        assert (await c.report()).reachability == cpb.REACHABILITY_DIRECT


async def test_a_dialer_that_hangs_is_cut_off_by_the_checks_deadline() -> None:
    dialer = FakeDialer({"h:1": "a"})
    dialer.hold = asyncio.Event()  # never set
    async with checking(dialer, timeout_s=0.1) as c:
        c.checker.announced(announce("a", "h:1"))
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert "no answer within 0.1 s" in report.detail


async def test_the_checker_holds_only_present_peers() -> None:
    dialer = FakeDialer({f"h:{i}": f"p{i}" for i in range(200)})
    async with checking(dialer) as c:
        for i in range(200):
            c.checker.announced(announce(f"p{i}", f"h:{i}"))
        for _ in range(200):
            await c.report()
        for i in range(200):
            c.checker.announced(cpb.PeerAnnouncement(peer=f"p{i}", state=cpb.PEER_STATE_OFFLINE))
        for _ in range(500):
            if len(c.published) == 400:
                break
            await asyncio.sleep(0.01)
        checker = c.checker
        assert checker.reports == {} and checker._targets == {} and checker._due == {}
        assert checker._misses == {} and checker._checking == {}
        assert sorted(p for p, report in c.published if report is None) == sorted(
            f"p{i}" for i in range(200)
        )


@pytest.mark.attack("M-scan")
@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:22",
        "[::1]:22",
        "localhost:6379",
        "10.1.2.3:80",
        "192.168.1.20:7000",
        "169.254.169.254:80",
        "100.64.0.1:80",
        "203.0.113.9:7700",
        "0.0.0.0:1",
    ],
)
async def test_no_private_address_is_dialled_without_dial_private(address: str) -> None:
    """Issue 54, M-scan: what a peer announces is dialled only when public; --dial-private
    (`DialScope(allow_private=True)`) allows the rest."""
    refused = await DialScope().refuses(address)
    assert refused is not None and refused.startswith(NOT_DIALLED), refused
    assert await DialScope(allow_private=True).refuses(address) is None
    assert await DialScope().refuses("8.8.8.8:7700") is None
    dialer = FakeDialer({address: "a"})
    async with checking(dialer, scope=DialScope()) as c:
        c.checker.announced(announce("a", address, relay="127.0.0.1:7900"))
        report = await c.report()
        assert dialer.calls == []  # neither its address nor its relay's
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert report.detail.startswith("a private address, not dialled"), report.detail
        assert "--dial-private" in report.remedy


@pytest.mark.attack("M-scan")
async def test_the_peer_is_told_the_cause_not_the_error_and_its_checks_are_paced() -> None:
    """The published report says the cause only ("no answer"), the scheduler's own keeps the
    dial's error; a peer changing its address at every announcement is dialled at most once
    per `min_interval_s`."""
    clock = [1000.0]
    dialer = FakeDialer()
    async with checking(dialer, min_interval_s=60.0, now=lambda: clock[0]) as c:
        c.checker.announced(announce("a", "h:1"))
        report = await c.report()
        assert "Connection refused" in report.detail  # the operator's, in the scheduler's log
        published = [r for p, r in c.published if p == "a" and r is not None]
        assert [r.detail for r in published] == ["no answer"]
        for i in range(2, 30):  # a scan of ports, an announcement each
            c.checker.announced(announce("a", f"h:{i}"))
            await asyncio.sleep(0.005)
        assert dialer.calls == ["h:1"]  # the rest wait for the interval
        clock[0] += 61.0
        c.checker._wake.set()
        await c.report()
        assert dialer.calls == ["h:1", "h:29"]  # the latest only


@pytest.mark.attack("M-scan")
async def test_the_first_relay_of_a_peer_found_unreachable_is_checked_at_once_and_once() -> None:
    """A peer behind NAT started without `--behind-nat` attaches to a relay when its first
    report says unreachable, and announces it: that check waits no dial pace (it read relayed
    about 9 s after its start, the pace's 5 s of it). Once a peer id: a new id is checked at
    once anyway, so this gives a token holder nothing more; every later change is paced."""
    clock = [1000.0]
    first, second = (paths.relayed_address("a", "h:1", r) for r in ("r:1", "r:2"))
    dialer = FakeDialer({first: "a", second: "a"})
    async with checking(dialer, min_interval_s=60.0, now=lambda: clock[0]) as c:
        c.checker.announced(announce("a", "h:1"))
        assert (await c.report()).reachability == cpb.REACHABILITY_UNREACHABLE
        c.checker.announced(announce("a", "h:1", relay="r:1"))
        assert (await c.report()).reachability == cpb.REACHABILITY_RELAYED  # no clock moved
        assert dialer.calls == ["h:1", "h:1", first]
        c.checker.announced(announce("a", "h:1", relay="r:2"))  # another relay: paced
        c.checker.announced(announce("a", "h:1"))
        c.checker.announced(announce("a", "h:1", relay="r:1"))  # its first again: paced too
        await asyncio.sleep(0.05)
        assert dialer.calls == ["h:1", "h:1", first]
        clock[0] += 61.0
        await _calls(c, 5)
        assert dialer.calls[3:] == ["h:1", first]
        c.checker.announced(cpb.PeerAnnouncement(peer="a", state=cpb.PEER_STATE_OFFLINE))
        assert c.checker._pace._unpaced == set(), "held for present peers only"


@pytest.mark.attack("M-scan")
async def test_a_peer_gets_one_unpaced_relay_check_and_only_at_the_address_found_unreachable() -> (
    None
):
    clock = [1000.0]
    dialer = FakeDialer()  # nothing answers: not at its address, nor through a relay
    async with checking(dialer, min_interval_s=60.0, now=lambda: clock[0]) as c:
        c.checker.announced(announce("a", "h:1"))
        await c.report()
        c.checker.announced(announce("a", "h:2"))  # an address never checked: paced
        c.checker.announced(announce("a", "h:2", relay="r:1"))  # so is its relay
        await asyncio.sleep(0.05)
        assert dialer.calls == ["h:1"]
        clock[0] += 61.0
        await _calls(c, 3)  # h:2 and its relay: unreachable at h:2, through r:1 too
        c.checker.announced(announce("a", "h:2"))
        clock[0] += 61.0
        await _calls(c, 4)  # unreachable at h:2, alone
        c.checker.announced(announce("a", "h:2", relay="r:2"))  # its once, unspent: at once
        await _calls(c, 6)
        c.checker.announced(announce("a", "h:2"))
        clock[0] += 61.0
        await _calls(c, 7)
        c.checker.announced(announce("a", "h:2", relay="r:3"))  # the once is spent: paced
        await asyncio.sleep(0.05)
        assert len(dialer.calls) == 7, dialer.calls


async def test_newcomers_are_checked_before_known_peers() -> None:
    clock = [1000.0]
    dialer = FakeDialer({"h:1": "old", "h:2": "new", "h:3": "b"})
    async with checking(dialer, concurrency=1, recheck_s=10.0, now=lambda: clock[0]) as c:
        c.checker.announced(announce("old", "h:1"))
        await c.report()
        dialer.hold = asyncio.Event()
        c.checker.announced(announce("b", "h:3"))  # holds the one slot
        while not dialer.in_flight:
            await asyncio.sleep(0.01)
        clock[0] += 20.0  # old's re-check is due ...
        c.checker.announced(announce("new", "h:2"))  # ... as a newcomer comes
        await asyncio.sleep(0.05)
        dialer.hold.set()
        while len(dialer.calls) < 4:
            await asyncio.sleep(0.01)
        assert dialer.calls == ["h:1", "h:3", "h:2", "h:1"], dialer.calls


async def _calls(c: Checked, n: int) -> None:
    """Until the checker has dialled `n` times (woken: the fake clock moved)."""
    c.checker._wake.set()
    async with asyncio.timeout(10):
        while len(c.dialer.calls) < n:
            await asyncio.sleep(0.01)


@pytest.mark.attack("L-dial")
async def test_an_unreachable_peer_is_retried_ever_less_often() -> None:
    """Issue 54 (Low): a peer id parked at a silent address is retried after `retry_s`, then
    twice that, ... up to `recheck_s`; an answer, or a new address, starts over."""
    clock = [1000.0]
    dialer = FakeDialer()
    async with checking(dialer, retry_s=10.0, recheck_s=60.0, now=lambda: clock[0]) as c:
        c.checker.announced(announce("a", "h:1"))
        await _calls(c, 1)
        for wait_s in (10.0, 20.0, 40.0, 60.0, 60.0):
            dials = len(dialer.calls)
            clock[0] += wait_s - 1.0  # not yet due
            c.checker._wake.set()
            await asyncio.sleep(0.05)
            assert len(dialer.calls) == dials, f"retried before {wait_s} s"
            clock[0] += 1.0
            await _calls(c, dials + 1)
        dialer.answers["h:2"] = "a"
        c.checker.announced(announce("a", "h:2"))  # a new address: checked at once
        await c.report()
        assert dialer.calls[-1] == "h:2"


async def test_a_peers_first_check_without_a_relay_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 68 item 4: every normal start behind NAT logged `WARNING peer X is unreachable (a
    private address, not dialled): give it --announce-host ...`, seconds before the peer was
    relayed. Its first check, with no relay announced, is said at INFO; a check that fails
    again, or one through its relay, at WARNING."""
    caplog.set_level(logging.INFO, logger="scheduler.reachability")
    # A scheduler on a public host dials no private address: the peer's LAN address is not
    # dialled (an address that was dialled and did not answer warns at once: the test below).
    async with checking(FakeDialer(), retry_s=0.05, scope=DialScope()) as c:
        c.checker.announced(announce("a", "192.168.1.20:5000"))
        await c.report()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "peer a is not reachable directly" in caplog.text
        # checked again, still nothing (the same report, not published again): now trouble
        await wait_until(lambda: _warned(caplog), "the second failed check warned")
        assert _warned(caplog)[0].startswith("peer a is unreachable"), _warned(caplog)
        assert len(c.published) == 1


async def test_a_first_check_that_dialled_and_got_no_answer_warns_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer at an address the scheduler did dial, and which did not answer, is no start
    behind NAT on its way to a relay: said at WARNING from the first check."""
    caplog.set_level(logging.INFO, logger="scheduler.reachability")
    async with checking(FakeDialer(), scope=DialScope(allow_private=True)) as c:
        c.checker.announced(announce("a", "127.0.0.2:5000"))
        await c.report()
        assert _warned(caplog) and _warned(caplog)[0].startswith("peer a is unreachable")


def _warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.attack("64-dial")
@pytest.mark.parametrize(
    "address", ["ipv4:127.0.0.1:22", "ipv6:[::1]:22", "dns:///localhost:22", "unix:/run/x.sock"]
)
async def test_only_a_plain_host_port_is_dialled(address: str) -> None:
    """Issue 64, item 6: gRPC targets other than host:port passed the scope as names resolving
    nowhere, and were dialled to the scheduler's own loopback or a Unix socket, its token
    included. Refused whatever the scope, before any dial."""
    for scope in (DialScope(), DialScope(allow_private=True)):
        refused = await scope.refuses(address)
        assert refused is not None and refused.startswith(NOT_DIALLED), refused
    dialer = FakeDialer({address: "a"})
    async with checking(dialer, scope=DialScope(allow_private=True)) as c:
        c.checker.announced(announce("a", address))
        report = await c.report()
        assert dialer.calls == [] and report.reachability == cpb.REACHABILITY_UNREACHABLE


@pytest.mark.parametrize(
    "address", ["a..example.com:7000", f"{'a' * 64}.example.com:7000", f"{'a.' * 200}com:7000"]
)
async def test_a_name_no_resolver_takes_is_refused_once_and_said_once(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An empty label or one over 63 characters passed as a name, and the resolver raised
    # UnicodeError (no OSError): an ERROR traceback, and the same check again at once, some
    # 4,000 lines a second for one announcement, the peer never told.
    caplog.set_level(logging.INFO, logger="scheduler.reachability")
    refused = await DialScope().refuses(address)
    assert refused is not None and refused.startswith(NOT_DIALLED), refused
    dialer = FakeDialer({address: "a"})
    async with checking(dialer) as c:
        c.checker.announced(announce("a", address))
        report = await c.report()
        await asyncio.sleep(0.5)
    assert dialer.calls == [] and report.reachability == cpb.REACHABILITY_UNREACHABLE
    lines = [r for r in caplog.records if r.name == "scheduler.reachability"]
    assert len(lines) < 5 and not any(r.levelno >= logging.ERROR for r in lines), lines


async def test_an_address_longer_than_any_name_is_refused_and_not_echoed_whole() -> None:
    # A 1 MB address went into the scheduler's retained report twice (its detail and its
    # remedy): past the broker's packet cap, which closed the scheduler's connection, and each
    # reconnect sent it again.
    address = "x" * 1_050_000 + ".com:7000"
    refused = await DialScope().refuses(address)
    assert refused is not None and refused.startswith(NOT_DIALLED) and len(refused) < 300


@pytest.mark.attack("64-dial")
async def test_a_failed_dial_is_said_as_late_as_a_silent_one() -> None:
    """Issue 64, item 6: a closed port's report came 0.01 s after its check began, a silent
    one's 2 s after, so the peer told the scheduler's network's open ports apart. A failure is
    now said no sooner than the dial's timeout after it began, whatever failed."""
    loop = asyncio.get_running_loop()
    async with checking(FakeDialer(), timeout_s=0.3, pace_failures=True) as c:
        began = loop.time()
        c.checker.announced(announce("a", "h:1"))  # refused at once
        report = await c.report()
        assert report.reachability == cpb.REACHABILITY_UNREACHABLE
        assert loop.time() - began >= 0.3
