"""Spares: the peers placed on a job's stages that the job does not need to serve, so that one
can stand by for a stage (issue 67) at no cost to the job.

Pure policy over plain data (docs/architecture.md, "Policies"). "Needs" is rebalancing's notion
(`swarm.policy.rebalance`): the job runs at its bottleneck, the smallest summed samples/s of a
stage's replicas, and no stage goes below `min_replicas` replicas (nor below one). A set of peers
is spare when, with them serving nothing, every stage keeps its floor and the bottleneck stays
where it is with every placed peer serving. So:
- a job with one peer per stage has no spare (each is its stage's last replica);
- two stages of two equal peers each have none (taking one drops its stage, and so the job, to
  half);
- a third peer on a stage of a two-stage job whose other stage has one is spare (the other
  stage is the bottleneck: the third peer adds nothing to the job's rate).
Speeds are each peer's samples/s at its stage (`speeds[k][peer]`, as `plan_move` weighs them).
Where a placed peer's speed is not known (0: not measured or not announced yet) the totals would
say nothing true, so every peer counts as one replica of equal weight instead: spares are then
only peers beyond the most thinly served stage's count.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

__all__ = ["bottleneck", "spare"]

# Totals are float sums taken in different orders: a loss within this is no loss.
_REL_TOL = 1e-9


def bottleneck(speeds: Sequence[Mapping[str, float]], out: Collection[str] = ()) -> float:
    """The job's rate with `out` serving nothing: the smallest stage total of the others
    (counting each peer as 1.0 where some speed is unknown, `_weights`)."""
    weights = _weights(speeds)
    return min(
        (sum(w for peer, w in stage.items() if peer not in out) for stage in weights), default=0.0
    )


def spare(
    speeds: Sequence[Mapping[str, float]], out: Collection[str], min_replicas: int = 1
) -> bool:
    """Whether the job loses nothing with `out` (peers placed on its stages) serving nothing:
    every stage they are taken from keeps `max(1, min_replicas)` replicas, and the bottleneck
    stays that of every placed peer serving."""
    keep = max(1, min_replicas)
    for stage in speeds:  # a stage short of its floor anyway is no reason to keep another's
        if any(p in out for p in stage) and sum(p not in out for p in stage) < keep:
            return False
    before = bottleneck(speeds)
    return bottleneck(speeds, out) >= before * (1.0 - _REL_TOL)


def _weights(speeds: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """`speeds`, or 1.0 for every peer where any speed is not known (not positive)."""
    known = all(s > 0.0 for stage in speeds for s in stage.values())
    return [{peer: (s if known else 1.0) for peer, s in stage.items()} for stage in speeds]
