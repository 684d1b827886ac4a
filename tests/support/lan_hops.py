"""The job two peers behind one router train while their pushes are counted, and what they may
take from the relay (issue 51 item 7, issue 65's "Tests that cannot fail"): shared by
tests/system/test_lan_direct.py and tests/system/test_friends_home.py.

One microbatch in flight (`max_in_flight = 1`): the probe of stage 1's LAN address starts with
the first push and goes on beside it (`swarm.rpc.lan`), one Info call straight over the LAN that
answers long before that push has gone through the relay, both stages and back; every push
already in flight when it answers goes through the relay too: with the default window that was
the whole first step's (4 of 24 pushes, 69 KB of the 77 KB relayed, measured), which a bound of
one push cannot tell from a LAN path lost for a step."""

from __future__ import annotations

from pathlib import Path

from tests.support.jobs import write_job

STEPS = 6
MICROBATCHES = 4  # a step's (target_batch_size / microbatch_size)
PUSHES = STEPS * MICROBATCHES  # stage 0 pushes each microbatch to stage 1 once
PUSH_BYTES = 4 * 16 * 32 * 8  # a push's activations alone (microbatch x seq_len x d_model, float64)
CONTROL_BYTES = 16 * 1024
"""What stage 1's host may take from the relay during the job besides pushes: the coordinator's
calls and any later dial-back, 6.0-6.1 KB in a job of 10-15 s and 9.1 KB in one of 124 s (peers
throttled 1000x; measured, about 26 B/s more as the job lasts: 14 KB at the 300 s the tests
wait for it), 8.2 KB over TLS (test_friends_home); a push takes 17.6 KB on the wire (its
activations, their framing), 20 KB over TLS, more than this by itself, so two pushes never
fit."""


def write_lan_job(directory: Path) -> Path:
    """A 2-stage job on the push data plane, one microbatch in flight, float64 (the base's)."""
    return write_job(
        directory,
        training={
            "stages": 2,
            "steps": STEPS,
            "checkpoint_every": 0,
            "microbatch_size": 4,
            "target_batch_size": 4 * MICROBATCHES,
        },
        model={"seq_len": 16, "d_model": 32},
        runtime={"data_plane": "push", "max_in_flight": 1},
    )


def assert_hops_over_the_lan(
    lan: int, relayed: dict[int, int], opened: dict[int, int], said: object
) -> None:
    """Stage 1's host took the hops from stage 0's over the LAN (`lan` bytes from its address):
    at least every push but one (each at least its activations); through the relay (`relayed`,
    by connection, less those `opened` before the job: the host's attachment), the control
    calls and the first push (before the probe answered) at most, a push as the LAN counted
    them (their bytes over those pushes: less than a push's own where more than one was
    relayed). `said` goes with a failure."""
    in_job = sum(n for port, n in relayed.items() if port not in opened)
    assert lan >= (PUSHES - 1) * PUSH_BYTES, (lan, said)
    assert in_job <= CONTROL_BYTES + lan / (PUSHES - 1), (in_job, relayed, said)
