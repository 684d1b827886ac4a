"""Single disagreements kept across a job's rounds and steps (`sent_words`): one word against one
convicts no one in its round, and both parties are left out; a party in disagreement with two
others convicts itself there. Kept, a liar that rejoins and lies again to another honest member
is in disagreement with two others over time, which its round alone cannot see: a member hiding
a NaN from one owner went with it, came back first (its copy was quicker), and in the pool of
two left it lied to the other; there the one other contributor is a majority, the honest owner
went alone, and the liar served its stage unchecked.

The premise is `sent_words.liars`': framing an honest party takes two liars, of two hosts (two
seats of one host are one token holder's word). Over steps one liar may come back under another
peer id, so a counterpart's host counts only where it is a public IP (an IPv6 one by its /64):
a name, a private address or a relayed seat counts for none (one operator could be any number
of them), and two public hosts are needed. A pair's disagreement is kept `KEPT_STEPS` steps
(all forgotten at a rollback, whose steps come again), a convicted party's forgotten by
everyone, and a party keeps at most `MOST_OTHERS` counterparts (the newest): bounded whatever
the churn."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.coordinator.groups import RoundGroup
from scheduler.coordinator.trust.sent_words import LIARS_AT, by_seed, disagreements
from scheduler.coordinator.trust.sum_checks import Checksums
from swarm.net.seats import seat
from swarm.rpc.lease import Replica

__all__ = ["KEPT_STEPS", "MOST_OTHERS", "UNKNOWN", "KeptDisputes", "Party", "host_of"]

KEPT_STEPS = 16
MOST_OTHERS = 8
UNKNOWN = "an unknown host"  # a name, a private address or a relayed seat: one for all


def host_of(address: str, peer: str) -> str:
    """The host a replica's `address` is on, as kept evidence counts hosts (`UNKNOWN` unless a
    public IP: a liar back under another id may take another name, port or relay)."""
    try:
        ip = ipaddress.ip_address(seat(address, peer))
    except ValueError:
        return UNKNOWN
    if not ip.is_global:
        return UNKNOWN
    if isinstance(ip, ipaddress.IPv6Address):  # one machine may hold a whole /64
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@dataclass(frozen=True)
class Party:
    """One side of a disagreement: a replica's peer id and the host its seat is on."""

    peer: str
    host: str


@dataclass(frozen=True)
class _Kept:
    host: str
    step: int
    line: str


class KeptDisputes:
    """One job's single disagreements, by peer, as the module says."""

    def __init__(self) -> None:
        self._of: dict[str, dict[str, _Kept]] = {}  # peer -> its counterpart's peer -> the latest
        self._step = -1  # the latest step a round was judged at

    def note(self, step: int, a: Party, b: Party, line: str) -> None:
        """`a` and `b` disagreed at `step` (`line`: the round's words for it)."""
        for one, other in ((a, b), (b, a)):
            kept = self._of.setdefault(one.peer, {})
            kept.pop(other.peer, None)  # newest last
            kept[other.peer] = _Kept(other.host, step, line)
            while len(kept) > MOST_OTHERS:
                del kept[next(iter(kept))]

    def at(self, step: int) -> None:
        """A round of `step` is judged: what is older than `KEPT_STEPS` goes, and everything
        at a rollback (its steps come again: what was kept of them was of another trajectory)."""
        if step < self._step:
            self._of.clear()
        self._step = step
        for peer in [p for p, kept in self._of.items() if _oldest(kept) <= step - KEPT_STEPS]:
            kept = {o: k for o, k in self._of[peer].items() if k.step > step - KEPT_STEPS}
            if kept:
                self._of[peer] = kept
            else:
                del self._of[peer]

    def forget(self, peer: str) -> None:
        """`peer` is convicted: its word is no one's evidence any more (nor its own record)."""
        for other in self._of.pop(peer, {}):
            kept = self._of.get(other, {})
            kept.pop(peer, None)
            if not kept:
                self._of.pop(other, None)

    def liars(self, peers: Iterable[str]) -> dict[str, str]:
        """Those of `peers` in disagreement with `LIARS_AT` others or more, on two public hosts
        or more (`host_of`), over the steps kept: each with the evidence, in one line."""
        out = {}
        for peer in peers:
            kept = self._of.get(peer, {})
            hosts = {k.host for k in kept.values()} - {UNKNOWN}
            if len(kept) >= LIARS_AT and len(hosts) >= 2:
                steps = sorted({k.step for k in kept.values()})
                newest = list(kept.values())[-1].line
                out[peer] = (
                    f"it disagreed with {len(kept)} others about what was sent over steps "
                    f"{', '.join(map(str, steps))} ({newest})"
                )
        return out

    def convicted(
        self,
        step: int,
        groups: Mapping[int, RoundGroup],
        checks: Mapping[int, Mapping[int, Checksums]],
        members: Sequence[Sequence[Replica]],
    ) -> dict[int, dict[int, str]]:
        """A failed round's disagreements (`checks`: stage -> contributor -> its checksums;
        `members`: per stage, its replicas in group order) kept, and the members they convict
        with those of the steps before: stage -> group index -> the evidence."""
        self.at(step)
        out: dict[int, dict[int, str]] = {}
        for stage, of in checks.items():
            group, replicas = groups[stage], members[stage]
            m = len(group.members) - len(group.aggregators)
            if m < 2 or len(replicas) < m:
                continue
            pairs = zip(replicas[:m], group.members[:m], strict=True)
            party = [Party(r.peer, host_of(address, r.peer)) for r, address in pairs]
            for d in disagreements(by_seed(of), m):
                self.note(step, party[d.member], party[d.owner], d.line())
            peers = [p.peer for p in party]
            for peer, evidence in self.liars(peers).items():
                out.setdefault(stage, {})[peers.index(peer)] = evidence
        return out


def _oldest(kept: Mapping[str, _Kept]) -> int:
    return min(k.step for k in kept.values())
