"""A pytest plugin for bench/gpu_check.sh: keeps only the tests that need CUDA and writes their
outcomes as JSON to $GPU_CHECK_TESTS_JSON, so the check can tell "passed on the GPU" from
"skipped: no GPU".

    python -m pytest -p bench.gpu_cuda_tests tests

A test needs CUDA when it says so (issue 63): a `skipif` mark whose reason names CUDA ("needs
CUDA", "needs a CUDA device"; a parameter's marks count, as `tests.support.cuda_param` gives
them), or a `device` parameter that is a CUDA `torch.device`. Not the word "cuda" in its name
or its file: a test of the CUDA handover's handle parsing runs on a CPU, and one skipped
"where torch has a GPU" never runs on one. Nor a `device` parameter that is the string
"cuda:N" alone: such a test is of what a name decides (`swarm.device.kernels` reads "CUDA:1"),
and the suite, green on a CPU, runs it there; a string that does put the test on the device
comes with the skip (`tests.support.cuda_param`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

__all__ = ["needs_cuda"]

_CUDA = re.compile(r"\bcuda\b", re.IGNORECASE)
_DEVICE_PARAMS = ("device", "devices")
_outcomes: dict[str, str] = {}


def _on_cuda(value: Any) -> bool:
    """A parameter's value that is a CUDA `torch.device` (or a list or tuple holding one)."""
    if isinstance(value, list | tuple):
        return any(_on_cuda(v) for v in value)
    return type(value).__name__ == "device" and getattr(value, "type", None) == "cuda"


def needs_cuda(item: pytest.Item) -> bool:
    """Whether `item` is a test that needs CUDA (the module's docstring)."""
    for mark in item.iter_markers("skipif"):
        if _CUDA.search(str(mark.kwargs.get("reason", ""))):
            return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(_on_cuda(params[name]) for name in _DEVICE_PARAMS if name in params)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [i for i in items if needs_cuda(i)]
    drop = [i for i in items if not needs_cuda(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module that did not import here (a package the host lacks): named by the check.
    if report.failed:
        _outcomes[report.nodeid] = "uncollected"
        _write()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A failure in setup or teardown counts; a skip is decided in setup.
    counts = report.when == "call" or report.outcome != "passed"
    if counts and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = report.outcome
        _write()  # after each test: a run its part's timeout ends still says what it found


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    _write()


def _write() -> None:
    path = os.environ.get("GPU_CHECK_TESTS_JSON")
    if path:
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(_outcomes, f)
        os.replace(path + ".part", path)
