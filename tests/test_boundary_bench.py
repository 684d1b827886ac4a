"""bench/boundary.py's arguments: `--rank 48,96` scores each subspace row at each rank in the one
run (same-run ratios), one rank keeps the rows' plain names, and a bad rank list is refused
before any namespace is made; `--factor 32,64` (the default) shapes the links at each factor,
each scored against the one unshaped pass, and `--quick` caps each at 4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import boundary


def test_several_ranks_give_each_subspace_row_once_per_rank() -> None:
    args = boundary.parse_args(["--rows", "full,full+codec,subspace+codec", "--rank", "48,96"])
    got = [(r.name, r.subspace, r.codec, r.rank) for r in args.row_list]
    assert got == [
        ("full", False, "none", 0),
        ("full+codec", False, "hadamard3", 0),
        ("subspace+codec@48", True, "hadamard3", 48),
        ("subspace+codec@96", True, "hadamard3", 96),
    ]
    jobs = [boundary.job_text(args, r, 10, 5) for r in args.row_list[2:]]
    assert "boundary_rank = 48\n" in jobs[0] and "boundary_rank = 96\n" in jobs[1]
    assert "boundary_rank" not in boundary.job_text(args, args.row_list[0], 10, 5)


def test_one_rank_keeps_the_row_names() -> None:
    args = boundary.parse_args(["--rows", "subspace,subspace+codec", "--rank", "32"])
    assert [(r.name, r.rank) for r in args.row_list] == [
        ("full", 0),
        ("subspace", 32),
        ("subspace+codec", 32),
    ]
    assert [r.rank for r in boundary.parse_args([]).row_list if r.subspace] == [48, 48]


@pytest.mark.parametrize("bad", ["0", "48,x", "48,48", ",", "-4"])
def test_a_bad_rank_list_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        boundary.parse_args(["--rank", bad])
    assert exited.value.code == 2
    assert "--rank" in capsys.readouterr().err


def test_the_links_are_shaped_at_each_factor_and_quick_caps_them() -> None:
    assert boundary.parse_args([]).factors == [32.0, 64.0]
    assert boundary.parse_args(["--factor", "16"]).factors == [16.0]
    assert boundary.parse_args(["--quick"]).factors == [4.0]  # 32 and 64 both capped: one pass
    assert boundary.parse_args(["--quick", "--factor", "2,8"]).factors == [2.0, 4.0]


@pytest.mark.parametrize("bad", ["1", "32,x", "0.5", ""])
def test_a_bad_factor_list_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        boundary.parse_args(["--factor", bad])
    assert exited.value.code == 2
    assert "--factor" in capsys.readouterr().err
