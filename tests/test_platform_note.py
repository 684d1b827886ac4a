"""docs/deployment.md's note on Windows (WSL2) and macOS claims only what the code does: each
`--device` it names is accepted by the device check on a machine that has that device, and
refused, with the words the note quotes, where there is none (`swarm doctor`, run for real on
this machine); `make install` needs what the note says it needs."""

from __future__ import annotations

import re
import sys
import tomllib

import pytest
import torch

from swarm.device.facts import find_device
from swarm.errors import SwarmError
from tests.support.cli import ROOT, swarm
from tests.support.devices import FakeFacts, Gpu

DOC = ROOT / "docs" / "deployment.md"
HEADING = "### Stage servers on Windows (WSL2) and macOS"


def _note() -> str:
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} has no heading {HEADING!r}"
    return re.split(r"\n#{1,3} ", text.split(HEADING, 1)[1], maxsplit=1)[0]


def _devices() -> list[str]:
    return sorted(set(re.findall(r"--device ([a-z]+(?::\d+)?)", _note())))


def test_the_note_names_the_devices_of_both_platforms() -> None:
    assert _devices() == ["cpu", "cuda:0", "mps"]


@pytest.mark.parametrize("spec", _devices())
def test_each_device_the_note_names_is_accepted_where_the_machine_has_it(spec: str) -> None:
    has_it = FakeFacts(gpus=[Gpu()], mps=True)
    assert find_device(spec, has_it) == torch.device(spec)


def test_mps_is_refused_with_the_words_the_note_quotes_on_a_machine_without_it() -> None:
    quoted = re.search(r"`(FAIL device: --device mps: [^`]*)`", _note())
    assert quoted is not None, "the note quotes the doctor's answer for mps"
    with pytest.raises(SwarmError) as refused:
        find_device("mps", FakeFacts())
    assert quoted.group(1).removeprefix("FAIL device: ") == str(refused.value)


@pytest.mark.skipif(
    torch.backends.mps.is_available(), reason="this machine has MPS: the doctor passes it"
)
def test_the_doctor_on_this_machine_answers_for_mps_as_the_note_says() -> None:
    """For real: this machine's torch sees no MPS (Linux; a Mac without an Apple GPU)."""
    quoted = re.search(r"`(FAIL device: --device mps: [^`]*)`", _note())
    assert quoted is not None
    if torch.cuda.is_available():  # the note quotes a machine with nothing but a CPU
        pytest.skip("this machine has a GPU: the doctor lists it after cpu")
    result = swarm("doctor", "--device", "mps", check=False, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert quoted.group(1) in result.stdout.splitlines()


def test_make_install_needs_only_python_and_make() -> None:
    """The note: `make install` wants Python 3.11 or later and `make`; `make test` is Linux's
    (apt-get)."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^install: \$\(STAMP\)$", makefile, re.M)  # nothing of apt-get's
    stamp = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "apt-get" not in stamp and "sudo" not in stamp.lower()
    test_target = re.search(r"^test: (.*)$", makefile, re.M)
    assert test_target is not None and "nftables" in test_target.group(1)
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert required == ">=3.11" and "Python 3.11 or later" in _note()
    assert sys.version_info >= (3, 11)


def test_native_windows_is_said_unsupported_for_the_reason_in_the_code() -> None:
    identity = (ROOT / "stage_server" / "peer" / "identity.py").read_text()
    assert "import fcntl" in identity and "`fcntl`" in _note()
