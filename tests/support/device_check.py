"""The device check's quick run on this machine's CPU (`bench/gpu_check.sh --device cpu --quick`,
as CI runs it), once per pytest run (`tests.support.once`): tests/system/test_gpu_check.py reads
its parts, and tests/system/test_gpu_cuda_tests.py the tests its "CUDA tests" part picked from
the suite. That part collects the whole suite; a second collection of it, for the same outcomes,
cost another ~10 s of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.once import once

__all__ = ["Checked", "quick_check"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Checked:
    """One quick run of the device check on the CPU: its exit status, output and $OUT, and the
    folder its run kept its work in (TMPDIR)."""

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


@pytest.fixture(scope="module")
def quick_check(tmp_path_factory: pytest.TempPathFactory) -> Checked:
    """The check, run once per pytest run (`once`: the tests that read it may be dealt to both
    workers, and sit in two modules)."""
    with once(tmp_path_factory, "gpu-check") as (tmp_path, first):
        if first:
            env = {
                **os.environ,
                "PYTHON": sys.executable,
                "OUT": str(tmp_path / "out"),
                "GPU_CHECK_WHEELS": "",
                "TMPDIR": str(tmp_path),
            }
            done = subprocess.run(
                [str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--quick"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=500,  # the check's own budget (QUICK_TOTAL_S) and its smoke's, beyond it
            )
            (tmp_path / "code").write_text(str(done.returncode))
            (tmp_path / "output").write_text(done.stdout + done.stderr)
        code = int((tmp_path / "code").read_text())
        return Checked(code, (tmp_path / "output").read_text(), tmp_path / "out", tmp_path)
