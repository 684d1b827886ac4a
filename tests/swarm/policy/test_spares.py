"""Which peers placed on a job's stages it does not need to serve (`swarm.policy.spares`): what a
standby may be taken from at no cost to the job (issue 67)."""

from __future__ import annotations

from swarm.policy.spares import bottleneck, spare


def test_one_peer_per_stage_has_no_spare() -> None:
    speeds = [{"a": 10.0}, {"b": 10.0}]
    assert not spare(speeds, {"a"})
    assert not spare(speeds, {"b"})


def test_a_stage_of_two_needs_both_where_the_other_is_as_fast() -> None:
    # Two stages of two equal peers: taking one halves its stage, and so the job.
    speeds = [{"a": 10.0, "b": 10.0}, {"c": 10.0, "d": 10.0}]
    assert not any(spare(speeds, {p}) for p in "abcd")


def test_a_peer_beyond_the_bottleneck_is_spare() -> None:
    # Stage 1 is the bottleneck (10): stage 0 keeps 10 without either of its peers.
    speeds = [{"a": 10.0, "b": 10.0}, {"c": 10.0}]
    assert bottleneck(speeds) == 10.0
    assert spare(speeds, {"a"}) and spare(speeds, {"b"})
    assert not spare(speeds, {"a", "b"})  # never a stage's last replica
    assert not spare(speeds, {"c"})


def test_the_floor_keeps_its_replicas() -> None:
    speeds = [{"a": 10.0, "b": 10.0, "e": 10.0}, {"c": 10.0, "d": 10.0}]
    assert spare(speeds, {"a"}, min_replicas=2)
    assert not spare(speeds, {"a", "b"}, min_replicas=2)
    # A stage short of its floor anyway does not stop another stage's spare.
    assert spare([{"a": 10.0, "b": 10.0}, {"c": 5.0}], {"a"}, min_replicas=2) is False
    assert spare([{"a": 10.0, "b": 10.0, "e": 1.0}, {"c": 5.0}], {"e"}, min_replicas=2)


def test_unknown_speeds_count_each_peer_as_one() -> None:
    # Speeds not measured (0): totals would say nothing, so replicas are counted.
    speeds = [{"a": 0.0, "b": 0.0, "e": 0.0}, {"c": 5.0, "d": 5.0}]
    assert spare(speeds, {"a"})
    assert not spare(speeds, {"a", "b"})
    assert not spare([{"a": 0.0, "b": 0.0}, {"c": 5.0, "d": 5.0}], {"a"})
