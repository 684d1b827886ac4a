"""What the averaging round's checksum costs a contributor (issue 55, item 4), against an unchecked
round's reduce measured in the same run, before and after r is kept from a slice's contribution
to its sum (`stage_server.averaging.checksum.Draws`) and drawn in place; and with the owner's
words about what each sender sent its part (`PartChecks.summing`, issue 55).

    .venv/bin/python bench/checksum.py [--numel 4194304] [--members 3] [--repeats 5]

One contributor's share of a round of `--members` over a float32 vector of `--numel` values, cut
in parts as a round cuts it (`swarm.policy.parts`, equal weights) and each part in the round's
slices: every slice checked as it is contributed and again as its sum comes back, in the order a
round does it. "before": r drawn anew at each (the code as it was: a splitmix64 hash per element,
twice a round, and Σ|r_i·S_i| taken of each sum though nothing reads it); "after": this
checkout's `PartChecks`. Both report the same checksums (r is the same bits; the dots' rounding
is within the coordinator's tolerance), which the bench asserts. The baseline: the pool's sum of
the members' contributions over the whole vector (the owners' `Averager.summer`, unchecked), the
work one round's reduce does in this process. The best of `--repeats` of each, interleaved,
single-threaded (the machine's other load moves every figure; the ratios are the result).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stage_server.averaging.butterfly import SLICE_BYTES  # noqa: E402
from stage_server.averaging.checksum import BLOCK, PartChecks  # noqa: E402
from stage_server.averaging.owner import Averager  # noqa: E402
from swarm.policy.parts import EQUAL_PARTS  # noqa: E402
from swarm.wire.codec import CODEC_NONE  # noqa: E402

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _weights_before(seed: int, start: int, stop: int) -> torch.Tensor:
    """r as it was drawn: each step a new array."""
    z = np.uint64(seed) + (np.arange(start, stop, dtype=np.uint64) + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0)


def _dots_before(seed: int, start: int, values: torch.Tensor) -> tuple[float, float, float]:
    """`checksum.dots` as it was: r drawn here, every time."""
    dot, magnitude, squares = [], [], []
    pos, end = start, start + values.numel()
    while pos < end:
        stop = min(end, (pos // BLOCK + 1) * BLOCK)
        r = _weights_before(seed, pos, stop)
        x = values[pos - start : stop - start].to(device="cpu", dtype=torch.float64)
        squares.append(float(torch.dot(x, x)))
        product = r.mul_(x)
        dot.append(float(product.sum()))
        magnitude.append(float(product.abs_().sum()))
        pos = stop
    return math.fsum(dot), math.fsum(magnitude), math.fsum(squares)


def _slices(numel: int, members: int) -> list[tuple[int, slice]]:
    step = SLICE_BYTES // 4
    out = []
    for k, part in enumerate(EQUAL_PARTS.bounds(numel, members)):
        out += [(k, slice(a, min(a + step, part.stop))) for a in range(part.start, part.stop, step)]
    return out


def before(seed: int, x: torch.Tensor, s: torch.Tensor, cuts: list[tuple[int, slice]]) -> list:
    got = []
    for _, w in cuts:
        got.append(_dots_before(seed, w.start, x[w]))
        got.append(_dots_before(seed, w.start, s[w])[0::2])  # its magnitude: drawn, unread
    return got


def after(seed: int, x: torch.Tensor, s: torch.Tensor, cuts: list[tuple[int, slice]]) -> list:
    checks = PartChecks(seed)
    for k, w in cuts:
        checks.contributed(k, w.start, x[w])
        checks.summed(k, w.start, s[w])
    return [(c.dot, c.magnitude, c.norm, c.sum_dot, c.sum_norm) for c in checks.report()]


def owning(
    seed: int, xs: list[torch.Tensor], s: torch.Tensor, cuts: list[tuple[int, slice]]
) -> list:
    """`after`, as the owner of part 0 also says what each sender sent it (issue 55:
    `PartChecks.summing`, one more dot per element and sender of its own part)."""
    checks = PartChecks(seed)
    for k, w in cuts:
        checks.contributed(k, w.start, xs[0][w])
        if k == 0:
            checks.summing(k, w.start, [x[w] for x in xs])
        checks.summed(k, w.start, s[w])
    return checks.report()


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(args.numel, generator=gen) for _ in range(args.members)]
    total = Averager().summer([x.clone() for x in xs], [False] * args.members, CODEC_NONE, 2048)
    cuts, seed = _slices(args.numel, args.members), 0x5EED_1234
    # The same checksums, before and after (per part: the slices' sums of each figure).
    old = before(seed, xs[0], total.tensor, cuts)
    new = after(seed, xs[0], total.tensor, cuts)
    for k, (dot, magnitude, norm, sum_dot, sum_norm) in enumerate(new):
        mine = [i for i, (part, _) in enumerate(cuts) if part == k]
        was = [math.fsum(old[2 * i + j][0] for i in mine) for j in (0, 1)]
        # The float64 dots' rounding bound (`scheduler.coordinator.trust.sum_checks`): BLOCK·2^-53
        # of Σ|r·x|; of the sum, Σ|r·S| <= √n·‖S‖.
        n = sum(cuts[i][1].stop - cuts[i][1].start for i in mine)
        assert abs(dot - was[0]) <= 2 * BLOCK * 2.0**-53 * magnitude, (k, dot, was)
        assert abs(sum_dot - was[1]) <= 2 * BLOCK * 2.0**-53 * math.sqrt(n) * sum_norm, k
        assert norm == math.sqrt(math.fsum(old[2 * i][2] for i in mine)), k
    said = next(c for c in owning(seed, xs, total.tensor, cuts) if c.part == 0)
    assert said.received_dots[0] == new[0][0]  # its word about its own is its own
    timings: dict[str, list[float]] = {"reduce": [], "before": [], "after": [], "owning": []}
    for _ in range(args.repeats):  # interleaved: the machine's load moves all three alike
        timings["reduce"].append(
            best(
                lambda: Averager().summer(
                    [x.clone() for x in xs], [False] * args.members, CODEC_NONE, 2048
                ),
                1,
            )
        )
        timings["before"].append(best(lambda: before(seed, xs[0], total.tensor, cuts), 1))
        timings["after"].append(best(lambda: after(seed, xs[0], total.tensor, cuts), 1))
        timings["owning"].append(best(lambda: owning(seed, xs, total.tensor, cuts), 1))
    reduce, old_s, new_s, own_s = (min(timings[k]) for k in ("reduce", "before", "after", "owning"))
    print(
        f"{args.numel} float32 values, {args.members} members, slices of {SLICE_BYTES >> 20} MiB, "
        f"best of {args.repeats}, one thread"
    )
    print(f"{'':<34} {'seconds':>9} {'x reduce':>9}")
    print(f"{'unchecked reduce (the pool sum)':<34} {reduce:>9.4f} {1.0:>9.2f}")
    print(f"{'checksum, before':<34} {old_s:>9.4f} {old_s / reduce:>9.2f}")
    print(f"{'checksum, after':<34} {new_s:>9.4f} {new_s / reduce:>9.2f}")
    print(f"{'checksum, and the owner words':<34} {own_s:>9.4f} {own_s / reduce:>9.2f}")
    print(f"after / before: {new_s / old_s:.2f}; and the owner words / after: {own_s / new_s:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4 << 20)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args())
