"""A swarm whose peers all hold the operator's own credentials (issue 69, item 3): the scheduler
says so once (`swarm scheduler --trusted-peers`), and its jobs' audits are then off by default.

Why a setting of the scheduler's and not a job's default: an audit re-executes a replica's work
to catch a peer that lies (docs/jobs.md, "Trust"), and whether any peer might lie is a fact of
the swarm, which its operator knows (one admin, no invites to others) and a job's author may not.
So the default stays secure (`[trust] audit_fraction` 0.045: any holder of the swarm's token may
serve a job), and only the operator turns it off, for every job at once, never silently:

- **At submit**: a job that does not set `[trust] audit_fraction` has `audit_fraction = 0.0`
  written into its stored spec (`swarm.job.pinning.pin`), which every trainer and stage server
  builds the job from; one that sets it is kept as it said (its author asked for audits, or for
  none: respected either way, never overruled).
- **In status**: every job whose audits are off under this setting says "audits off: the
  scheduler trusts its peers" among its warnings (`swarm status`, `swarm watch`)."""

from __future__ import annotations

import asyncio
import hashlib
import tomllib
from collections import OrderedDict

from swarm.job.pinning import pin
from swarm.proto.scheduler_pb2 import JobStatus

__all__ = ["AUDITS_OFF", "TrustMode", "audits_off", "trusted"]

AUDITS_OFF = "audits off: the scheduler trusts its peers"
KEPT_SPECS = 1024  # specs whose audits `TrustMode` remembers, the least recently shown forgotten


def trusted(spec: str) -> str:
    """`spec` as a scheduler that trusts its peers stores it: `[trust] audit_fraction = 0.0`
    written in where the job does not set it, else unchanged."""
    doc = tomllib.loads(spec)
    table = doc.get("trust", {})
    if isinstance(table, dict) and "audit_fraction" in table:
        return spec  # the job's own word
    return pin(spec, "trust", "audit_fraction", 0.0)


def audits_off(spec: str) -> bool:
    """Whether a stored `spec` audits nothing (`audit_fraction` 0)."""
    table = tomllib.loads(spec).get("trust", {})
    return isinstance(table, dict) and table.get("audit_fraction", 1.0) == 0


class TrustMode:
    """The scheduler's trust mode as its job API applies it: at submit (`stored`) and in every
    job's status (`shown`). `trusted`: `--trusted-peers`; else both leave the job as it is."""

    def __init__(self, trusted_peers: bool) -> None:
        self.trusted_peers = trusted_peers
        # Whether each stored spec audits nothing, by its digest: parsed once, not at each
        # GetJob (a 1 MiB spec is 0.2 s of the event loop's time in the TOML parser).
        self._off: OrderedDict[bytes, bool] = OrderedDict()

    def stored(self, spec: str) -> str:
        """The spec to store for a job submitted as `spec`."""
        return trusted(spec) if self.trusted_peers else spec

    async def shown(self, status: JobStatus) -> JobStatus:
        """`status` (a job's, its spec in it) with "audits off" among its warnings where this
        mode turned them off: never silently. A spec not seen yet is parsed off the event loop
        (a 1 MiB one is ~0.35 s of the TOML parser's time: a submission's answer, and any
        status after a restart, held the loop that long)."""
        if self.trusted_peers and await self._audits_off(status.spec):
            status.warnings.append(AUDITS_OFF)
        return status

    async def _audits_off(self, spec: str) -> bool:
        key = hashlib.blake2b(spec.encode(), digest_size=16).digest()
        if key not in self._off:
            off = await asyncio.to_thread(audits_off, spec)
            self._off[key] = off
            if len(self._off) > KEPT_SPECS:
                self._off.popitem(last=False)
        self._off.move_to_end(key)
        return self._off[key]
