"""What a stalled or warned job says (`scheduler.stalls`' words): which stages wait and since
when, what is done about it and what happens then, a home's outage named as one, a relay that
is gone, and the warnings of stages with a single replica or all their replicas in one failure
domain. Kept apart from the watch that decides when to say them, so each reads alone."""

from __future__ import annotations

import time

__all__ = [
    "REMEDY",
    "crowded_text",
    "home_down_text",
    "lost_stage_text",
    "relay_down_text",
    "single_replica_text",
    "stages_text",
    "under_replicated_text",
]

REMEDY = "start a stage server for this job (`swarm stage-server --broker URL`, as for the others)"


def stages_text(stages: list[int]) -> str:
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))


def relay_down_text(relay: str) -> str:
    """The remedy of a stage whose replicas were reached only through `relay`, which is gone."""
    return (
        f"the relay is down: its replicas were reached only through relay {relay}, which is "
        "gone; restart the relay (`swarm relay`), or run a second relay on another reachable "
        "host (peers behind NAT attach to it by themselves)"
    )


def home_down_text(
    router: str, peers: list[str], since: float, step: int, then: str, stages: int = 1
) -> str:
    """What is known of `stages` stage(s) whose replicas (`peers`) all sat behind `router`
    (their public address) and went at `since`: one home's outage, not a missing server (issue
    68 item 3)."""
    at = time.strftime("%H:%M:%S", time.localtime(since))
    whose, it = ("its", "the stage") if stages == 1 else ("their", "them")
    return (
        f"{whose} replicas ({', '.join(peers)}) all sit behind router {router}, unreachable "
        f"since {at}: if they come back, training goes on from step {step} and nothing is lost; "
        f"if other stage servers take {it} instead, {then}"
    )


def lost_stage_text(
    missing: list[int],
    step: int,
    checkpoint: int,
    since: float,
    plans: dict[int, str] | None = None,
    relays: dict[int, str] | None = None,
    homes: dict[int, tuple[str, list[str]]] | None = None,
    barred: dict[int, list[str]] | None = None,
    refused: dict[int, str] | None = None,
) -> str:
    """The message of a job stalled because `missing` stages have no replica; `plans`: what the
    scheduler does about some of them (`Mover.refill`); `relays`: the relay gone that cut others
    off (`relay_down_text`); `homes`: the router every replica of others sat behind (and those
    replicas), one home's outage (`home_down_text`); the others' remedy is `REMEDY`. `barred`:
    the servers still on some of them that are banned from the job (no replica of it), named;
    `refused`: the peer sent to some of them that refused the job, with its words."""
    at = time.strftime("%H:%M:%S", time.localtime(since))
    verb = "has" if len(missing) == 1 else "have"
    if checkpoint > 0:
        then = f"every stage rolls back to step {checkpoint}, the last checkpoint"
        if step > checkpoint:
            then += f" ({step - checkpoint} step(s) trained again)"
    else:
        then = f"training starts again from step 0 (no checkpoint yet: {step} step(s) lost)"
    plans = {k: what for k, what in (plans or {}).items() if k in missing}
    relays = {k: relay for k, relay in (relays or {}).items() if k in missing and k not in plans}
    homes = {k: h for k, h in (homes or {}).items() if k in missing and k not in plans}
    behind: dict[str, list[int]] = {}  # router -> the stages whose replicas all sat behind it
    for k, (router, _) in homes.items():
        behind.setdefault(router, []).append(k)
    outages = {  # one sentence per router, for all the stages behind it
        router: home_down_text(
            router, [p for k in ks for p in homes[k][1]], since, step, then, len(ks)
        )
        for router, ks in behind.items()
    }

    def fix(k: int) -> str:
        if k in plans:
            return f"the scheduler is {plans[k]}"
        if k in relays:
            return relay_down_text(relays[k])
        return outages[homes[k][0]] if k in homes else REMEDY

    fixes: dict[str, list[int]] = {}  # one remedy, said once for all the stages it applies to
    for k in missing:
        fixes.setdefault(fix(k), []).append(k)
    if list(fixes) == [REMEDY]:
        remedy = f"{REMEDY}: it takes the stage, and {then}"
    elif len(fixes) == 1 and missing[0] in homes:
        remedy = fix(missing[0])  # says both ends itself
    elif homes:  # an outage's sentence says both ends itself
        remedy = "; ".join(f"{stages_text(ks)}: {what}" for what, ks in fixes.items())
    elif len(fixes) == 1:
        once = "it serves" if plans else "they are reached again"
        remedy = f"{fix(missing[0])}: once {once}, {then}"
    else:
        each = "; ".join(f"{stages_text(ks)}: {what}" for what, ks in fixes.items())
        remedy = f"{each}; once every stage is served, {then}"
    bans = [f"{stages_text([k])}'s {', '.join(p)}" for k, p in (barred or {}).items() if p]
    why = f" (banned from this job: {'; '.join(bans)})" if bans else ""
    said = [f"{stages_text([k])}: {what}" for k, what in (refused or {}).items() if k not in plans]
    why += f" ({'; '.join(said)})" if said else ""
    return (
        f"stalled at step {step}: {stages_text(missing)} {verb} no replica since {at}{why}; "
        f"{remedy}"
    )


def single_replica_text(stages: list[int], peers: list[str], checkpoint: int) -> str:
    """The warning for `stages`, each served by one replica (`peers`, in their order), of a job
    with `min_replicas` = 1: it names the servers a spare for each takes."""
    spares = len(stages)
    return (
        f"{_single(stages, peers, checkpoint)}; a spare stage server would take over without "
        f"loss ({spares} more stage server(s) with runtime.min_replicas = 2, or the scheduler's "
        f"--min-replicas 2, give {'it' if spares == 1 else 'each'} one)"
    )


def under_replicated_text(
    sizes: list[int], min_replicas: int, peers: list[list[str]], checkpoint: int
) -> str:
    """The warning for a job whose stages have `sizes` replicas (`peers`: each stage's), some
    below `min_replicas` (> 1): which, and how many more stage servers would fill every stage
    (joining peers fill the stages short of it first)."""
    short = [k for k, n in enumerate(sizes) if n < min_replicas]
    more = sum(min_replicas - sizes[k] for k in short)
    if len(short) == 1:
        which = f"stage {short[0]} has {sizes[short[0]]} of min_replicas = {min_replicas} replicas"
    else:
        counts = ", ".join(str(sizes[k]) for k in short)
        which = f"{stages_text(short)} have fewer than min_replicas = {min_replicas} ({counts})"
    text = f"{which}: {more} more stage server(s) would fill every stage"
    single = [k for k in short if sizes[k] == 1]
    if single:
        text += "; " + _single(single, [peers[k][0] for k in single], checkpoint)
    return text


def crowded_text(stage: int, kind: str, domain: str, peers: list[str]) -> str:
    """The warning for a stage whose replicas (`peers`) all share one `kind` ("host" or
    "router") of failure domain, `domain`."""
    if kind == "host":
        where, other = f"run on one machine ({domain})", "another machine"
    else:
        where, other = f"sit behind one router ({domain})", "another network"
    return (
        f"stage {stage}'s replicas ({', '.join(peers)}) all {where}: one outage stops it; a stage "
        f"server on {other} would spread it"
    )


def _single(stages: list[int], peers: list[str], checkpoint: int) -> str:
    back = f"step {checkpoint}, the last checkpoint" if checkpoint else "step 0 (no checkpoint)"
    if len(stages) == 1:
        which = f"stage {stages[0]} has a single replica ({peers[0]}): if it is lost"
    else:
        which = (
            f"{stages_text(stages)} have a single replica each ({', '.join(peers)}): if one is lost"
        )
    return f"{which}, training rolls back to {back}"
