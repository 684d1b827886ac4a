"""How long a thread of a role process may hold the GIL while another waits for it, before it
must hand it over (`sys.setswitchinterval`): `SWITCH_S`, where Python's default is 5 ms.

Why (issue 69, the peer workload against torch pipelining): a stage server runs two busy Python
threads. Its worker computes the stage; torch's kernels run without the GIL, but the Python
between them needs it. Its event loop reads and writes the pushes (gRPC's calls, their
protobufs, the tensors' bytes), in runs of Python a few milliseconds long. Each thread that
waits more than the switch interval makes the other drop the GIL at its next bytecode, and each
such handover is two context switches on cores that are already full. With a longer interval a
run of either finishes where it would have been cut. Measured, not modelled: on the peer
workload (bench/small_stages.py, alternated pairs, 4 stage servers and a trainer on 2 cores,
every role process set alike) 0.5 ms read 0.986 of the default's samples/s, 20 ms 1.001, 50 ms
1.015, 1.022 and 1.011 (17 pairs, 14 of them above 1), 100 ms 1.003 (5 of 5 above 1), 200 ms
0.999, and the same two trees without it 0.994; the figures are in docs/decisions.md.
Torch's own pipelining, the baseline, runs each rank's Python on one thread.

The cost it bounds: a thread that waits for the GIL waits at most this long for a run of the
other's Python. A stage server's loop answers its health checks and load reports in that time
still (their deadlines are seconds), and a worker's kernels never hold the GIL at all.

`swarm.cli.entry` sets it for the `swarm` command's own processes only: never a test's
interpreter that calls `main` in-process."""

from __future__ import annotations

import sys

__all__ = ["SWITCH_S", "hold_longer"]

SWITCH_S = 0.05  # seconds (Python's default: 0.005)


def hold_longer() -> None:
    """This process's threads hand the GIL over after `SWITCH_S`."""
    sys.setswitchinterval(SWITCH_S)
