"""The attack runner (`bench/hostile_inputs.py`, issue 54): it shows an attack refused only when
a test of it ran and passed; an attack without a test, or whose test was skipped (at set-up or in
the call), makes it exit 1. (Before: both exited 0, a set-up skip counted as "no test".) Run on
a directory of made-up attack tests, in its own process, as an operator runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("runner")]

_CONFTEST = """
def pytest_configure(config):
    config.addinivalue_line("markers", "attack(id): an attack")
    config.addinivalue_line("markers", "slow: slow")
"""

_TESTS = """
import pytest

@pytest.mark.attack("N1")
def test_refused():
    assert 1 + 1 == 2

@pytest.mark.attack("N2")
@pytest.mark.skipif(True, reason="no broker here")
def test_skipped_at_set_up():
    pass

@pytest.mark.attack("N3")
def test_skipped_in_the_call():
    pytest.skip("no nft here")

@pytest.mark.attack("N5")
@pytest.mark.slow
def test_slow():
    pass
"""


def _run(tests: Path, *flags: str) -> tuple[int, dict[str, str]]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hostile_inputs.py"), "--tests", str(tests), *flags],
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words and words[0] in ("N1", "N2", "N3", "N4", "N5"):
            lines[words[0]] = line
    return done.returncode, lines


def test_a_skipped_attack_or_one_without_a_test_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_attacks.py").write_text(_TESTS)
    rc, lines = _run(tmp_path)
    assert rc == 1
    assert "refused (1)" in lines["N1"]
    assert "skipped" in lines["N2"] and "skipped" in lines["N3"]
    assert "no test" in lines["N4"]
    assert "slow: --slow" in lines["N5"]  # its test exists, left out without --slow
    rc, lines = _run(tmp_path, "--slow")
    assert rc == 1 and "refused (1)" in lines["N5"]
