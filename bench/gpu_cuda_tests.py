"""A pytest plugin for bench/gpu_check.sh: keeps only the tests that need CUDA (a `skipif` whose
reason or condition names CUDA, or "cuda" in the test's name) and writes their outcomes as JSON
to $GPU_CHECK_TESTS_JSON, so the check can tell "passed on the GPU" from "skipped: no GPU".

    python -m pytest -p bench.gpu_cuda_tests tests/...
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_outcomes: dict[str, str] = {}


def _needs_cuda(item: pytest.Item) -> bool:
    if "cuda" in item.name.lower():
        return True
    for mark in item.iter_markers("skipif"):
        texts = [str(mark.kwargs.get("reason", "")), *(a for a in mark.args if isinstance(a, str))]
        if any("cuda" in t.lower() for t in texts):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [i for i in items if _needs_cuda(i)]
    drop = [i for i in items if not _needs_cuda(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A failure in setup or teardown counts; a skip is decided in setup.
    counts = report.when == "call" or report.outcome != "passed"
    if counts and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    path = os.environ.get("GPU_CHECK_TESTS_JSON")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_outcomes, f)
