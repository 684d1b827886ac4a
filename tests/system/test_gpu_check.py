"""The device check (bench/gpu_check.sh) on this machine's CPU, as CI runs it, so that the script
a GPU host runs has not rotted: every part passes, with its figures, and the summary lands in
$OUT. Its `gpu ratio` part is the side-by-side benchmark (bench/gpu_ratio.py) in its CPU mode:
every run finishes, swarm's losses agree with the single-process torch run's at every step, and
the table is printed with its ratios (read from that part's log; the benchmark ran a second time
on its own before, with the same arguments, for the same claims)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.device_check import STALL_S, Checked, run_check

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(520)]


def files_under(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_the_device_check_runs_green_on_a_cpu(quick_check: Checked) -> None:
    assert quick_check.code == 0, quick_check.output
    summary = quick_check.summary
    assert "9 of 9 parts passed" in summary, summary
    for part in (
        "environment",
        "smoke",
        "doctor",
        "CUDA tests",
        "train fp32",
        "train bf16-mixed",
        "llama-1b",
        "gpu ratio",
        "device faults",
    ):
        assert f"PASS    {part} (" in summary, summary
    # the tests that need CUDA: skipped here (no GPU asked), none failed
    assert re.search(r"CUDA tests \(\d+ s\): (\d+ passed, )?\d+ skipped \(no GPU", summary), summary
    assert "against the CPU reference: loss" in summary and "tokens/s" in summary
    # each stage's replicas downloaded after training: bitwise equal (the claim GPU hosts check)
    assert summary.count("replicas of each stage bitwise equal: yes") == 2, summary
    # the audits' part of it (issue 55): the quick job audits every microbatch, so audits ran
    # (the line alone read the same with none), and on a CPU whatever one compared was bitwise
    # equal
    assert (
        len(re.findall(r"audits [1-9]\d* agreed \(largest difference 0\.0e\+00\)", summary)) == 2
    ), summary
    assert "swarm against torch on the same device" in summary and "| swarm | " in summary
    assert "MPS A/B: not available: cpu is not a CUDA device" in summary, summary
    assert (quick_check.out / "gpu_check_logs" / "train-fp32.log").exists()
    # the device-failure part's dry run: the injected failure (no allocator to cap on a CPU),
    # replayed, and float64 against the CPU reference: bitwise on a CPU
    assert "float64 on cpu against the CPU reference 0.00e+00" in summary, summary
    assert "out of memory mid-backward (injected (cpu)), replayed: 0.00e+00" in summary, summary
    assert "bitwise the run without it: yes" in summary, summary
    # every part ended whole and was checked before the next: said in its figures
    assert summary.count("left behind: ") == 9, summary
    # $OUT: the summary and each part's log, as the plan says (a device run's is <= 8)
    assert files_under(quick_check.out) == sorted(
        ["gpu_check.txt"] + [f"gpu_check_logs/{p}.log" for p in QUICK_LOGS]
    ), files_under(quick_check.out)


QUICK_LOGS = (
    "environment",
    "smoke",
    "doctor",
    "CUDA-tests",
    "train-fp32",
    "train-bf16-mixed",
    "llama-1b",
    "gpu-ratio",
    "device-faults",
)


def test_the_ratio_bench_runs_on_a_cpu_and_swarm_agrees_with_torch(quick_check: Checked) -> None:
    """bench/gpu_ratio.py --cpu-tiny --shapes short --warmup 1 --steps 2 (the part's command)."""
    output = quick_check.log("gpu-ratio")
    assert "| run | tokens/s | ratio | p50 s | p90 s |" in output
    for run in ("microbatched-eager", "pass-eager", "swarm"):
        assert f"| {run} | " in output, output
    report = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert report["failures"] == [] and report["precision"] == "fp32"
    shape = report["shapes"]["short"]
    rows = shape["rows"]
    torch_losses, swarm = rows["microbatched-eager"]["losses"], rows["swarm"]
    assert len(swarm["losses"]) == len(torch_losses) == 3  # warm-up and timed steps
    assert swarm["loss_diff"] <= 1e-4  # the same microbatches, the same model, in fp32
    # the one-pass run trains on the same batch: its losses agree too
    for a, b in zip(rows["pass-eager"]["losses"], torch_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert shape["baseline"] == {"(a)": "microbatched-eager", "(b)": "pass-eager"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["p50_s"] <= row["p90_s"]
        assert row["busy"] is None and row["mfu"] is None  # no NVML, no known peak on a CPU
    assert 0 < swarm["commit_share"] < 1
    assert swarm["evictions"] == [0] * 4  # every stage server logged its count as it stopped
    assert shape["swarm_over_a"] > 0 and shape["swarm_over_b"] > 0


def test_parts_are_chosen_by_name_and_a_cpu_run_is_the_fault_check_s_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's own logic, in this process: `--parts` picks parts by name, in their order;
    the device faults part runs bench/gpu_fault_check.py on the device asked for."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = argparse.Namespace(
        device="cuda:1",
        quick=False,
        parts={"device faults", "environment"},
        ratio_shapes="short",
        smoke_stall_s=0.0,
    )
    check = gpu_check.Check(args)
    assert check.work.parent == tmp_path  # its logs under TMPDIR, not one more folder in /tmp
    assert [p.name for p in check.parts] == ["environment", "device faults"]
    # On a CPU `--parts smoke` runs the quick run's smoke command, so the quick run's smoke
    # stands for it (test_the_smoke_part_passes_on_a_cpu reads that one)
    chosen = argparse.Namespace(**{**vars(args), "device": "cpu", "parts": {"smoke"}})
    quick = argparse.Namespace(**{**vars(args), "device": "cpu", "parts": set(), "quick": True})
    smoke = gpu_check.Check(chosen).parts
    assert [p.name for p in smoke] == ["smoke"]
    assert smoke[0].command() == gpu_check.Check(quick).parts[1].command()
    assert smoke[0].timeout_s == gpu_check.Check(quick).parts[1].timeout_s
    assert check.index == "1" and check.cuda
    faults = check.parts[1].command()
    assert faults[1].endswith("bench/gpu_fault_check.py")
    assert faults[2:] == ["--device", "cuda:1", "--steps", "2"]
    figures = {"device": "cuda:1", "float64_rel_err": 3e-9, "after_failure_rel_err": 3e-9}
    figures |= {"failure": "real", "bitwise_as_without": True, "failures": ["float64 off"]}
    ok, text = check.parts[1].judge(1, "RESULT " + json.dumps(figures))
    assert not ok and "float64 on cuda:1 against the CPU reference 3.00e-09" in text
    assert "float64 off" in text
    assert not check.parts[1].judge(0, "killed before a result")[0]


def test_a_device_that_is_not_one_is_refused_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": ""}
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), "--device", "tpu:0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--device 'tpu:0': cpu or cuda:N" in done.stderr


def test_the_cuda_tests_part_runs_from_the_python_script_alone(tmp_path: Path) -> None:
    """`python bench/gpu_check.py` (its usage line) without gpu_check.sh: the part's pytest
    names the suite's two plugins itself, so it turns plugin autoloading off itself too. With
    autoloading on, pytest-asyncio loaded twice (its entry point and `-p`) and no test ran."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    script = str(ROOT / "bench" / "gpu_check.py")
    done = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--quick", "--parts", "CUDA tests"],
        cwd=ROOT,
        env={**env, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"PASS    CUDA tests \(\d+ s\): \d+ skipped \(no GPU", summary), summary


def test_the_device_check_fits_one_call_of_a_lent_machine(tmp_path: Path) -> None:
    """The plan a GPU host runs (`--plan`, nothing run): the smoke first after the versions,
    then the ratio at the long shape first, the CUDA tests, the device faults; each part's
    seconds within 8.5 minutes with the wheels' install (the smoke's two shapes each start four
    servers of the 1B model, train 2 steps and download the 4.4 GB state: 90 s was cut short);
    at most 8 files under $OUT."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    done = run_check(tmp_path, "--device", "cuda:0", "--plan")
    assert done.code == 0, done.output
    plan = json.loads(done.output.split("PLAN ", 1)[1].splitlines()[0])
    parts = plan["parts"]
    names = [p["name"] for p in parts]
    assert names == ["environment", "smoke", "gpu ratio", "CUDA tests", "device faults"]
    seconds = {p["name"]: p["timeout_s"] for p in parts}
    assert seconds["smoke"] <= 120
    # the install's bound is the script's own: the same seconds on both sides
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert f"WHEELS_S={gpu_check.WHEELS_S}\n" in script
    assert gpu_check.WHEELS_S + sum(seconds.values()) <= gpu_check.TOTAL_S <= 8.5 * 60
    assert plan["budget_s"] <= gpu_check.TOTAL_S  # counted from the script's start
    assert len(plan["out_files"]) <= 8 and "gpu_check.txt" in plan["out_files"]
    smoke = parts[1]["command"]
    assert smoke[1].endswith("bench/gpu_ratio.py") and "--smoke" in smoke
    assert smoke[smoke.index("--shapes") + 1] == "short,long"
    assert float(smoke[smoke.index("--budget-s") + 1]) < seconds["smoke"]
    ratio = parts[2]["command"]
    assert ratio[ratio.index("--shapes") + 1] == "long,short"
    assert float(ratio[ratio.index("--budget-s") + 1]) < seconds["gpu ratio"]
    tests = parts[3]["command"]  # the whole suite, bench/gpu_cuda_tests.py picks
    assert tests[-1] == "tests" and "bench.gpu_cuda_tests" in tests
    assert "installing" not in done.output  # a plan installs no wheels either


def test_the_smoke_part_passes_on_a_cpu(quick_check: Checked) -> None:
    """The device check's first part, as on a GPU, with the tiny model on the CPU: 2 steps on
    4 real stage servers x 1, both shapes, through the handover; their INFO logs kept. Read from
    the quick run, whose smoke is `--parts smoke`'s very command (checked in
    test_parts_are_chosen_by_name_and_a_cpu_run_is_the_fault_check_s_dry_run)."""
    summary = quick_check.summary
    smoke = summary.split("PASS    smoke (", 1)[1].split("PASS    doctor (", 1)[0]
    for shape in ("short", "long"):
        handed = re.search(rf"{shape}: losses \[[^\]]+\], (\d+) tensors handed over", smoke)
        assert handed and int(handed.group(1)) > 0, summary
    assert "left behind: no process" in smoke, summary
    log = quick_check.log("smoke")
    for shape in ("short", "long"):
        for k in range(4):  # each server's INFO log, its stop included
            assert f"--- {shape}-swarm-stage-{k}.log" in log, log
            assert f"INFO stage_server.server: stage {k}: stopped" in log, log


def test_a_failed_smoke_part_stops_the_check_with_its_error(failed_smoke: Checked) -> None:
    """Every stage server dies in step 1's backward (SWARM_FAULTS): the smoke part stalls, is
    stopped at its bound (10 s here, `--smoke-stall-s`: the bench's own 40 s only waits longer)
    with the trainer's last errors, and no part after it runs. (The same run shows the bench's
    stall in tests/system/test_gpu_ratio.py.)"""
    done = failed_smoke
    assert done.code == 1, done.output
    summary = done.summary
    assert "FAIL    smoke (" in summary, summary
    stalled = f"stalled: no committed step in {STALL_S} s"
    assert stalled in summary or "exit " in summary, summary
    assert "the trainer's last errors:" in summary and "backward@1" in summary, summary
    assert "device faults (0 s): not run: the smoke part failed" in summary, summary
    assert "0 of 2 parts passed" in summary, summary
    assert files_under(done.out) == ["gpu_check.txt", "gpu_check_logs/smoke.log"]


def test_the_gpu_idle_part_runs_only_where_named_and_fits_one_call_of_300_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--parts "environment,gpu idle"` (nothing run: --plan): the long shape eager beside
    torch's two runs, the servers sampled by py-spy, the trace and stacks under $OUT; with the
    wheels' install within 300 s, one call of a lent machine. The device check without --parts
    runs no such part, nor does --quick (CI)."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    done = run_check(tmp_path, "--device", "cuda:0", "--plan", "--parts", "environment,gpu idle")
    assert done.code == 0, done.output
    plan = json.loads(done.output.split("PLAN ", 1)[1].splitlines()[0])
    assert [p["name"] for p in plan["parts"]] == ["environment", "gpu idle"]
    seconds = sum(p["timeout_s"] for p in plan["parts"])
    assert gpu_check.WHEELS_S + seconds <= 300 - 15  # the command's own start and end
    idle = plan["parts"][1]["command"]
    assert (
        idle[1].endswith("bench/gpu_ratio.py") and "--py-spy" in idle and "--cpu-tiny" not in idle
    )
    assert idle[idle.index("--shapes") + 1] == "long" and idle[idle.index("--compile") + 1] == "off"
    assert float(idle[idle.index("--budget-s") + 1]) < plan["parts"][1]["timeout_s"]
    assert idle[idle.index("--out") + 1] == str(tmp_path / "out" / "gpu_idle")
    assert len(plan["out_files"]) <= 8 and "gpu_idle/trace-long-swarm.json" in plan["out_files"]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for quick in (False, True):
        args = argparse.Namespace(device="cpu", quick=quick, parts=set(), ratio_shapes="long")
        assert "gpu idle" not in [p.name for p in gpu_check.Check(args).parts]


def test_the_gpu_idle_part_says_where_the_time_went_or_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(ROOT))
    from bench import gpu_check

    monkeypatch.setenv("TMPDIR", str(tmp_path))

    args = argparse.Namespace(device="cpu", quick=False, parts={"gpu idle"}, ratio_shapes="long")
    (part,) = gpu_check.Check(args).parts
    table = "### long\n| run | tokens/s |\n| swarm | 1 |\n"
    told = "long swarm: #### Where a swarm step's time went\n| 2 | 0.1 |\nEvictions: none\n"
    ok, text = part.judge(0, table + told + 'RESULT {"failures": []}')
    assert ok and "| swarm | 1 |" in text and "Evictions: none" in text and "RESULT" not in text
    assert not part.judge(0, table + 'RESULT {"failures": []}')[0]  # no timeline: a failure
    assert not part.judge(1, table + told + 'RESULT {"failures": ["a loss"]}')[0]
