"""The device check's runs on this machine's CPU that several tests read, each once per pytest
run (`tests.support.once`):
- `quick_check`: the quick run (`bench/gpu_check.sh --device cpu --quick`, as CI runs it):
  tests/system/test_gpu_check.py reads its parts, and tests/system/test_gpu_cuda_tests.py the
  tests its "CUDA tests" part picked from the suite. That part collects the whole suite; a second
  collection of it, for the same outcomes, cost another ~10 s of CPU.
- `failed_smoke`: a check whose smoke part stalls on purpose (every stage server dies in step
  1's backward): tests/system/test_gpu_check.py reads how the check stops, and
  tests/system/test_gpu_ratio.py how the smoke's bench/gpu_ratio.py run stopped at its stall
  bound (its own run of the same stall, with the same arguments, cost ~25 s of CPU and a 10 s
  stall more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.once import once

__all__ = ["STALL_S", "Checked", "failed_smoke", "quick_check", "run_check"]

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 10  # the failed smoke's stall bound (bench/gpu_ratio.py's own 40 s only waits longer)


@dataclass
class Checked:
    """One run of the device check on the CPU: its exit status, output and $OUT, and the folder
    its run kept its work in (TMPDIR)."""

    code: int
    output: str
    out: Path
    work: Path

    @property
    def summary(self) -> str:
        return (self.out / "gpu_check.txt").read_text()

    def log(self, part: str) -> str:
        return (self.out / "gpu_check_logs" / f"{part}.log").read_text()

    def cuda_tests(self) -> dict[str, str]:
        """The "CUDA tests" part's outcomes by test (bench/gpu_cuda_tests.py's JSON), from the
        check's work folder."""
        found = sorted(self.work.glob("swarm-gpu-check-*/tests.json"))
        assert len(found) == 1, f"the CUDA tests part left {found}:\n{self.output[-3000:]}"
        return dict(json.loads(found[0].read_text()))


def run_check(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 400
) -> Checked:
    """bench/gpu_check.sh with `args`, no wheels, $OUT and TMPDIR under `tmp_path`."""
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), *args],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "OUT": str(tmp_path / "out"),
            "GPU_CHECK_WHEELS": "",
            "TMPDIR": str(tmp_path),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Checked(done.returncode, done.stdout + done.stderr, tmp_path / "out", tmp_path)


def _once(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 400,
) -> Checked:
    """`run_check(args)` once per pytest run (`once`: the tests that read it may be dealt to
    both workers, and sit in two modules); its exit status and output kept in its folder."""
    with once(tmp_path_factory, name) as (tmp_path, first):
        if first:
            done = run_check(tmp_path, *args, env=env, timeout=timeout)
            (tmp_path / "code").write_text(str(done.code))
            (tmp_path / "output").write_text(done.output)
        code = int((tmp_path / "code").read_text())
        return Checked(code, (tmp_path / "output").read_text(), tmp_path / "out", tmp_path)


@pytest.fixture(scope="module")
def quick_check(tmp_path_factory: pytest.TempPathFactory) -> Checked:
    """The quick run, once per pytest run."""
    # the check's own budget (QUICK_TOTAL_S) and its smoke's, beyond it
    return _once(tmp_path_factory, "gpu-check", "--device", "cpu", "--quick", timeout=500)


@pytest.fixture(scope="module")
def failed_smoke(tmp_path_factory: pytest.TempPathFactory) -> Checked:
    """`--parts "smoke,device faults"` with every stage server dying in step 1's backward
    (SWARM_FAULTS) and the smoke's stall bound `STALL_S`, once per pytest run."""
    return _once(
        tmp_path_factory,
        "gpu-check-failed-smoke",
        *("--device", "cpu", "--parts", "smoke,device faults"),
        *("--smoke-stall-s", str(STALL_S)),
        env={"SWARM_FAULTS": "backward@1"},
    )
