"""Stochastic wiring: the choice rule, backoffs, draining, load merging, and the shares it gives
replicas of unequal speed in a small discrete-event simulation."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest

from swarm.clock import FakeClock
from swarm.errors import ConfigError, SwarmError
from swarm.policy.wiring import NoReplicaError, StagePool, Wiring, WiringConfig


def make_pool(
    clock: FakeClock | None = None, seed: int = 0, **config: float
) -> tuple[StagePool, FakeClock]:
    clock = clock or FakeClock()
    pool = StagePool(clock=clock, rng=random.Random(seed), config=WiringConfig(**config))
    return pool, clock


def measured(pool: StagePool, peer: str, rate: float) -> None:
    """Give `peer` a measured throughput of `rate` samples/s (a finished task, queue unchanged)."""
    pool.started(peer, 1.0)
    pool.finished(peer, 1.0, 1.0 / rate)


# -- the choice ------------------------------------------------------------------------------------


def test_picks_smallest_expected_finish_time() -> None:
    pool, _ = make_pool()
    for peer, rate in [("a", 10.0), ("b", 5.0), ("c", 1.0)]:
        pool.add(peer, rate)
        measured(pool, peer, rate)
    pool.started("a", 30.0)  # (30 + 1) / 10 = 3.1
    pool.started("b", 5.0)  # (5 + 1) / 5 = 1.2
    pool.started("c", 1.0)  # (1 + 1) / 1 = 2.0
    assert pool.expected_finish("b") == pytest.approx(1.2)
    assert pool.choose(1.0) == "b"
    pool.started("b", 10.0)  # (15 + 1) / 5 = 3.2: c is next
    assert pool.choose(1.0) == "c"


def test_task_size_is_part_of_the_choice() -> None:
    pool, _ = make_pool()
    pool.add("slow_idle", 1.0)
    pool.add("fast_busy", 10.0)
    measured(pool, "slow_idle", 1.0)
    measured(pool, "fast_busy", 10.0)
    pool.started("fast_busy", 1.0)
    assert pool.choose(1.0) == "fast_busy"  # (1 + 1) / 10 = 0.2 beats (0 + 1) / 1 = 1
    assert pool.choose(0.01) == "slow_idle"  # 0.01 / 1 beats 1.01 / 10


def test_ties_are_broken_at_random() -> None:
    pool, _ = make_pool(seed=7)
    pool.add("a", 2.0)
    pool.add("b", 2.0)
    measured(pool, "a", 2.0)
    measured(pool, "b", 2.0)
    picks = [pool.choose(1.0) for _ in range(400)]
    assert 0.3 < picks.count("a") / len(picks) < 0.7
    firsts = set()
    for seed in range(20):  # and which one wins first depends on the injected generator
        pool, _ = make_pool(seed=seed)
        pool.add("a", 2.0)
        pool.add("b", 2.0)
        firsts.add(pool.choose(1.0))
    assert firsts == {"a", "b"}


def _two_busy() -> StagePool:
    """a and b, measured at 4 samples/s, each with 2 samples in flight."""
    pool, _ = make_pool()
    for peer in ("a", "b"):
        pool.add(peer, 4.0)
        measured(pool, peer, 4.0)
        pool.started(peer, 2.0)
    return pool


def test_new_replica_is_tried_soon() -> None:
    pool = _two_busy()
    # It announces a speed that would put it far behind everyone, yet enters at the current
    # minimum, ahead of the older replicas there.
    pool.add("new", 0.01)
    assert pool.choose(1.0) == "new"
    pool.started("new", 1.0)  # once tried, its own figures speak for it
    assert pool.choose(1.0) in {"a", "b"}
    assert pool.expected_finish("new") == pytest.approx(2.0 / 0.01)


def test_a_new_replica_is_tried_even_once_the_others_are_idle_again() -> None:
    """It enters while the others are busy, and they finish before the next choice: it must
    still be tried next. (It entered at the minimum key of that moment, which the idle others
    then undercut for good: a restarted replica rejoined and got no work for the rest of the
    job, tests/system/test_local_steps.py's rejoin.)"""
    pool = _two_busy()
    pool.add("new", 0.01)
    pool.finished("a", 2.0, 0.5)
    pool.finished("b", 2.0, 0.5)
    assert pool.choose(1.0) == "new"


@pytest.mark.parametrize("seed", range(8))
def test_replicas_that_join_together_are_each_tried_before_any_twice(seed: int) -> None:
    """A sender's first view of a stage adds its replicas together, none tried: each is tried
    before any goes again, even one task at a time, with the first measured far faster than
    the others' announcement. (Tied at first, they were not new: the first one measured got
    every task after it and the others none for good. A push-plane replica's next hop did so,
    and a liar of the stage after it was never routed to: tests/system/test_poison_push.py's
    poison-sent-outputs failed 1 run in 10.)"""
    pool, _ = make_pool(seed=seed)
    for peer in ("a", "b", "c"):
        pool.add(peer, 1.0)  # unknown speed, as `swarm.rpc.routes` adds it
    picks = []
    for _ in range(3):
        peer = pool.choose(4.0)
        picks.append(peer)
        pool.started(peer, 4.0)
        pool.finished(peer, 4.0, 0.05)  # 80 samples/s: far ahead of 1.0 announced
    assert sorted(picks) == ["a", "b", "c"]


def test_a_replica_measured_slow_once_is_tried_again_once_idle_long_enough() -> None:
    """One slow measurement (a busy 2-core machine, a cold start) must not keep a replica idle
    for good: only its own tasks can correct it. Left idle `probe_after` times its expected
    task time, it is tried once more; a replica that really is slow spends about 1/probe_after
    of its time on such tries. (A stage-2 replica measured 0.05 s for one microbatch beside one
    at 0.004 s got no work for the rest of a job: tests/system/test_faults.py's Llama kill.)"""
    pool, clock = make_pool(probe_after=10.0)
    for peer in ("a", "b"):
        pool.add(peer, 1.0)
    pool.started("a", 1.0)
    pool.finished("a", 1.0, 1.0 / 40.0)  # expected 1 / 40 = 0.025 s a task: due at 0.25 s idle
    pool.started("b", 1.0)
    pool.finished("b", 1.0, 1.0 / 450.0)
    picks = []
    for _ in range(24):  # b finishes each task long before a would
        peer = pool.choose(1.0)
        picks.append(peer)
        pool.started(peer, 1.0)
        clock.t += 0.01
        pool.finished(peer, 1.0, 1.0 / 450.0)
    assert set(picks) == {"b"} and clock.t < 0.25
    clock.t = 0.25
    assert pool.choose(1.0) == "a"  # its probe
    pool.started("a", 1.0)
    pool.finished("a", 1.0, 1.0 / 450.0)  # as fast as b after all: its figures catch up
    assert pool.throughput("a") > 40.0
    assert pool.choose(1.0) == "b"  # tried once: back to its own (still slower) figures


def test_draining_replicas_get_no_work() -> None:
    pool, _ = make_pool()
    pool.add("a", 100.0)
    pool.add("b", 1.0)
    measured(pool, "a", 100.0)
    measured(pool, "b", 1.0)
    pool.set_draining("a", True)
    assert pool.eligible() == ["b"]
    assert {pool.choose(1.0) for _ in range(20)} == {"b"}
    pool.set_draining("a", False)
    assert pool.eligible() == ["a", "b"]
    assert pool.choose(1.0) == "a"


def test_no_replica_error() -> None:
    pool, _ = make_pool()
    with pytest.raises(NoReplicaError):
        pool.choose(1.0)
    pool.add("a", 1.0)
    pool.set_draining("a", True)
    with pytest.raises(NoReplicaError, match="in backoff, draining or gone"):
        pool.choose(1.0)
    pool.set_draining("a", False)
    pool.failed("a")
    with pytest.raises(SwarmError):  # part of the project's hierarchy
        pool.choose(1.0)
    pool.remove("a")
    with pytest.raises(NoReplicaError):
        pool.choose(1.0)


# -- backoffs --------------------------------------------------------------------------------------


def test_backoffs_grow_expire_and_reset_on_success() -> None:
    pool, clock = make_pool(backoff_base_s=1.0, backoff_factor=2.0, backoff_max_s=5.0)
    pool.add("a", 1.0)
    pool.add("b", 1.0)

    def backoff_of_a() -> float:
        start = clock.t
        assert pool.failed("a") > 0.0
        assert "a" not in pool.eligible()
        assert pool.choose(1.0) == "b"
        until = pool.backoff_until("a")
        assert until is not None
        clock.t = until - 1e-6
        assert "a" not in pool.eligible()
        clock.t = until
        assert "a" in pool.eligible()  # expired by the clock: back in the pool
        return until - start

    assert backoff_of_a() == pytest.approx(1.0)
    assert backoff_of_a() == pytest.approx(2.0)  # doubles
    assert backoff_of_a() == pytest.approx(4.0)
    assert backoff_of_a() == pytest.approx(5.0)  # capped at backoff_max_s
    pool.started("a", 1.0)
    pool.finished("a", 1.0, 0.5)  # a success resets the count
    assert backoff_of_a() == pytest.approx(1.0)


def test_failures_of_one_outage_do_not_stretch_the_backoff() -> None:
    pool, clock = make_pool(backoff_base_s=1.0, backoff_factor=2.0)
    pool.add("a", 1.0)
    pool.started("a", 3.0)
    assert pool.failed("a", 1.0) == 1.0
    assert pool.failed("a", 1.0) == 0.0  # the other in-flight calls fail with it
    assert pool.failed("a", 1.0) == 0.0
    assert pool.queued("a") == 0.0  # their samples left the queue
    clock.t = 1.0
    assert pool.failed("a") == 2.0  # a new outage after the backoff: it grows


def test_removed_replica_stays_out_and_late_outcomes_are_ignored() -> None:
    pool, clock = make_pool()
    pool.add("a", 1.0)
    pool.add("b", 1.0)
    pool.failed("a")
    assert pool.remove("a")
    clock.t = 100.0
    assert pool.eligible() == ["b"]  # its backoff expired, but it is gone
    pool.finished("a", 1.0, 1.0)  # a reply that arrives after removal
    pool.started("a", 1.0)
    assert pool.failed("a") == 0.0
    assert "a" not in pool
    pool.add("a", 1.0)  # and the same id can come back fresh
    assert pool.eligible() == ["a", "b"]


# -- measurements and load reports -----------------------------------------------------------------


def test_throughput_is_an_ema_of_measurements() -> None:
    pool, _ = make_pool(throughput_ema_alpha=0.25)
    pool.add("a", 100.0)  # announced; the first measurement replaces it
    pool.started("a", 8.0)
    pool.finished("a", 8.0, 2.0)
    assert pool.throughput("a") == pytest.approx(4.0)
    pool.started("a", 8.0)
    pool.finished("a", 8.0, 1.0)  # 8/s
    assert pool.throughput("a") == pytest.approx(4.0 + 0.25 * (8.0 - 4.0))


def test_load_reports_merge_without_double_counting() -> None:
    pool, _ = make_pool()
    pool.add("a", 1.0)
    pool.started("a", 4.0)
    assert pool.report_load("a", 4.0, None)  # the replica sees only our 4 samples
    assert pool.queued("a") == 4.0
    assert pool.report_load("a", 10.0, None)  # 6 more from other trainers
    assert pool.queued("a") == 10.0
    pool.finished("a", 4.0, 4.0)  # ours leave at once; theirs stay until the next report
    assert pool.queued("a") == 6.0
    pool.started("a", 2.0)
    assert pool.queued("a") == 8.0
    assert pool.report_load("a", 1.0, None)  # report older than our work: never below our own
    assert pool.queued("a") == 2.0


def test_untrusted_reports_are_validated() -> None:
    pool, _ = make_pool()
    pool.add("a", 1.0)
    assert not pool.report_load("ghost", 1.0, 0.5)
    assert not pool.report_load("a", -1.0, None)
    assert not pool.report_load("a", math.nan, None)
    assert not pool.report_load("a", 1.0, 0.0)
    assert not pool.report_load("a", 1.0, math.inf)
    assert pool.queued("a") == 0.0
    assert pool.report_load("a", 0.0, 0.25)  # seeds the throughput until we measure our own
    assert pool.throughput("a") == 4.0
    measured(pool, "a", 2.0)
    assert pool.report_load("a", 0.0, 0.25)
    assert pool.throughput("a") == 2.0
    with pytest.raises(ValueError):
        pool.add("b", 0.0)
    with pytest.raises(ValueError):
        pool.started("a", -1.0)


def test_config_is_validated() -> None:
    for bad in (
        {"throughput_ema_alpha": 0.0},
        {"throughput_ema_alpha": 1.5},
        {"backoff_base_s": 0.0},
        {"backoff_factor": 0.5},
        {"backoff_base_s": 10.0, "backoff_max_s": 1.0},
    ):
        with pytest.raises(ConfigError):
            WiringConfig(**bad)


def test_wiring_routes_membership_by_stage() -> None:
    clock = FakeClock()
    wiring = Wiring(3, clock=clock, rng=random.Random(0))
    wiring.add("a", 0, 1.0)
    wiring.add("b", 1, 1.0)
    assert wiring.stages_without_eligible() == [2]
    wiring.add("a", 2, 1.0)  # rebalanced: leaves stage 0
    assert wiring.stage_of("a") == 2
    assert "a" not in wiring[0]
    assert wiring.stages_without_eligible() == [0]
    assert wiring.report_load("b", 3.0, None)
    assert wiring[1].queued("b") == 3.0
    assert not wiring.report_load("ghost", 3.0, None)
    wiring.set_draining("b", True)
    with pytest.raises(NoReplicaError):
        wiring.choose(1, 1.0)
    assert wiring.remove("b")
    assert not wiring.remove("b")
    with pytest.raises(ConfigError):
        Wiring(0, clock=clock, rng=random.Random(0))


# -- the shares it gives in a running system -------------------------------------------------------

TASK = 8.0  # samples per task
SPEEDS = {"slow": 1.0, "mid": 2.0, "fast": 4.0}  # samples/s


def simulate(trainers: int, in_flight: int, report_every_s: float | None, seed: int) -> dict:
    """Trainers each keep `in_flight` tasks out and replace each one as it finishes; replicas
    serve their queue first come, first served. Every `report_every_s`, each replica's queue (all
    trainers' work) reaches every trainer, as the MQTT load topic would, already stale by the time
    the next task goes out. Returns each replica's share of tasks after a warm-up."""
    clock = FakeClock()
    pools = []
    for i in range(trainers):
        pool = StagePool(clock=clock, rng=random.Random(1000 * seed + i), task_samples=TASK)
        for peer in SPEEDS:
            pool.add(peer, 1.0)  # speeds unknown at first: the pool must learn them
        pools.append(pool)
    free_at = dict.fromkeys(SPEEDS, 0.0)
    queued = dict.fromkeys(SPEEDS, 0.0)
    done: list[tuple[float, int, int, str]] = []  # (time, tie-break, trainer, peer)
    order = itertools.count()

    def send(i: int) -> None:
        peer = pools[i].choose(TASK)
        pools[i].started(peer, TASK)
        free_at[peer] = max(clock.t, free_at[peer]) + TASK / SPEEDS[peer]
        queued[peer] += TASK
        heapq.heappush(done, (free_at[peer], next(order), i, peer))

    for i in range(trainers):
        for _ in range(in_flight):
            send(i)
    counts = dict.fromkeys(SPEEDS, 0)
    next_report = report_every_s if report_every_s is not None else math.inf
    for finished in range(3000):
        while next_report <= done[0][0]:
            clock.t = next_report
            for pool in pools:
                for peer, speed in SPEEDS.items():
                    pool.report_load(peer, queued[peer], 1.0 / speed)
            next_report += report_every_s or math.inf
        clock.t, _, i, peer = heapq.heappop(done)
        queued[peer] -= TASK
        if finished >= 300:
            counts[peer] += 1
        pools[i].finished(peer, TASK, TASK / SPEEDS[peer])
        send(i)
    total = sum(counts.values())
    return {peer: count / total for peer, count in counts.items()}


def assert_shares_match_speed(shares: dict) -> None:
    total = sum(SPEEDS.values())
    for peer, speed in SPEEDS.items():
        assert shares[peer] == pytest.approx(speed / total, rel=0.10), shares


@pytest.mark.parametrize("seed", range(3))
def test_one_trainer_shares_follow_speed(seed: int) -> None:
    # 7 tasks in flight: enough that every replica stays busy when shares follow speed.
    assert_shares_match_speed(simulate(trainers=1, in_flight=7, report_every_s=None, seed=seed))


@pytest.mark.parametrize("seed", range(3))
def test_three_trainers_with_stale_reports_share_by_speed(seed: int) -> None:
    # Each trainer knows only its own work exactly; the rest comes from reports as old as one
    # task on the slow replica.
    shares = simulate(trainers=3, in_flight=4, report_every_s=TASK / SPEEDS["slow"], seed=seed)
    assert_shares_match_speed(shares)


def test_three_trainers_need_the_reports() -> None:
    # Without them each trainer balances only its own 3 tasks, all of which finish sooner on the
    # two fast replicas: the slow one starves, although all together keep 9 tasks in flight.
    shares = simulate(trainers=3, in_flight=3, report_every_s=None, seed=0)
    assert shares["slow"] < 0.02
    assert_shares_match_speed(simulate(trainers=3, in_flight=3, report_every_s=8.0, seed=0))


# -- cost ------------------------------------------------------------------------------------------


def heap_work(replicas: int, backoff_fraction: float) -> tuple[float, float]:
    """Heap operations per call over a workload on a pool of `replicas`: backoffs of a fraction of
    them, 2,000 choose/started/finished rounds, the backoffs expiring halfway. Returns (operations
    per call over everything, operations per call in the second half's rounds)."""
    pool, clock = make_pool(seed=1)
    for i in range(replicas):
        pool.add(f"p{i}", 1.0 + i % 7)
    start, calls = pool.heap_operations, 0
    for i in range(int(replicas * backoff_fraction)):
        pool.failed(f"p{i}")
        calls += 1

    def rounds() -> int:
        for _ in range(1000):
            peer = pool.choose(1.0)
            pool.started(peer, 1.0)
            pool.finished(peer, 1.0, 0.25)
        return 3000

    calls += rounds()
    clock.t = 1e6  # every backoff expires: each replica in backoff returns once
    pool.choose(1.0)
    calls += 1
    steady = pool.heap_operations
    calls += rounds()
    return (pool.heap_operations - start) / calls, (pool.heap_operations - steady) / 3000


@pytest.mark.parametrize("backoff_fraction", [0.0, 0.9])
def test_choice_costs_a_constant_number_of_heap_operations(backoff_fraction: float) -> None:
    # A push or pop is O(log n) (heapq) and the rest of the counted work O(1), so a bounded
    # count per call, no larger at 10,000 replicas than at 1,000, is O(log n) per choice. A scan
    # would read every replica. Here many replicas tie (seven speeds, all idle), so each choice
    # also reads its full _TIE_SCAN of tied entries.
    small_all, small_steady = heap_work(1_000, backoff_fraction)
    large_all, large_steady = heap_work(10_000, backoff_fraction)
    assert small_all < 10.0 and small_steady < 10.0
    assert large_all < 10.0 and large_steady < 10.0
    assert large_steady <= small_steady + 1.0
