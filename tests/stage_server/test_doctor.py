"""`swarm doctor` (`stage_server.doctor`): every failure named with its fix, on made-up machines for
the device facts, and for real for what it dials (a listening socket, a closed port) and for the
command on this machine."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stage_server.doctor import diagnose, stage_bytes
from stage_server.peer.network_checks import path_check
from swarm.net import invite
from tests.support.devices import FakeFacts, Gpu
from tests.support.jobs import write_job
from tests.support.ports import free_port

GiB = 1 << 30


def _job(tmp_path: Path) -> Path:
    return write_job(
        tmp_path,
        model={"d_model": 256, "n_layers": 4, "n_heads": 4, "vocab_size": 256},
        training={"stages": 2, "dtype": "float32"},
    )


def _failed(checks: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {c.name: c.fix for c in checks if not c.ok}


def test_a_healthy_gpu_host_passes(tmp_path: Path) -> None:
    checks = diagnose("cuda:0", FakeFacts(gpus=[Gpu()]), job=_job(tmp_path))
    assert [c.name for c in checks] == [
        "torch",
        "device",
        "kernels",
        "device memory",
        "host memory",
    ]
    assert _failed(checks) == {}
    assert "NVIDIA H100 80GB HBM3 (sm_90)" in checks[1].found


def test_the_largest_stage_against_free_memory(tmp_path: Path) -> None:
    job = _job(tmp_path)
    stage, params, need = stage_bytes(job)
    assert need == params * 4 * 4  # float32 weights, gradient sums, AdamW's two moments
    full = Gpu(free=need // 2)
    checks = diagnose("cuda:0", FakeFacts(gpus=[full], host=need // 3), job=job)
    failed = _failed(checks)
    assert set(failed) == {"device memory", "host memory"}
    assert "nvidia-smi" in failed["device memory"]
    memory = next(c for c in checks if c.name == "device memory")
    assert f"stage {stage}" in memory.found and f"{params / 1e6:.1f}M parameters" in memory.found


def test_no_kernels_for_this_gpu_is_named_with_the_fix(tmp_path: Path) -> None:
    facts = FakeFacts(gpus=[Gpu("NVIDIA GeForce RTX 5090", (12, 0))], arches=["sm_80", "sm_90"])
    checks = diagnose("cuda:0", facts, job=_job(tmp_path))
    failed = _failed(checks)
    assert list(failed) == ["kernels"], "no memory check on a device torch cannot run on"
    assert failed["kernels"].startswith("install a torch build for this GPU")
    assert "sm_120" in next(c for c in checks if c.name == "kernels").found


def test_a_cpu_only_torch_asked_for_a_gpu() -> None:
    failed = _failed(diagnose("cuda:0", FakeFacts(cuda=None)))
    assert failed == {
        "device": "install a CUDA build of torch (README, 'Installing on a GPU host')"
    }


def test_an_open_port_is_no_broker_and_a_closed_one_no_scheduler() -> None:
    """A port that accepts connections is not a broker that takes the login (the doctor once
    passed it); a real login passes in tests/stage_server/test_invite.py."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        closed = free_port()
        checks = diagnose(
            "cpu",
            FakeFacts(),
            broker=f"mqtt://127.0.0.1:{port}",
            scheduler=f"127.0.0.1:{closed}",
            timeout=2.0,
        )
    found = {c.name: c for c in checks}
    assert not found["broker"].ok, found["broker"]
    assert "start the broker" in found["broker"].fix
    assert "path" not in found  # judged only once the broker took the login
    assert not found["scheduler"].ok
    assert f"127.0.0.1:{closed} does not answer" in found["scheduler"].found
    assert "start the scheduler" in found["scheduler"].fix


@pytest.mark.timeout(120)
def test_swarm_doctor_on_this_machine(tmp_path: Path) -> None:
    """The command itself: exit 1 and the failed check named when one fails."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.cli",
            "doctor",
            "--device",
            "cpu",
            "--job",
            str(_job(tmp_path)),
            "--scheduler",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ok   device: cpu" in done.stdout
    assert "FAIL scheduler:" in done.stdout and "     fix: start the scheduler" in done.stdout
    assert "failed: scheduler" in done.stdout


@pytest.mark.attack("64.10")
def test_the_doctor_escapes_what_relays_announce() -> None:
    """Issue 64 item 10: a relay announced by a token holder wrote its own terminal escapes into
    a newcomer's first command (`swarm doctor --join`); now written out as `swarm status` does."""
    hostile = {"relay-\x1b]0;pwned\x07": "203.0.113.5:7100\x1b[2J\nok   all good"}
    found = path_check("192.168.1.10", "198.51.100.2", hostile).found
    assert "\x1b" not in found and "\n" not in found and "\x07" not in found, found
    assert "relay-\\x1b]0;pwned\\x07 (203.0.113.5:7100\\x1b[2J\\nok   all good)" in found


class _Resolver:
    """Looks names up as told: `hangs` never answers (a resolver that times out), others fail
    as a name nobody knows."""

    def __init__(self, hangs: str) -> None:
        self.hangs, self.asked = hangs, list[str]()

    async def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host == self.hangs:
            await asyncio.Event().wait()
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


def test_a_slow_name_lookup_is_its_own_check_not_a_scheduler_that_does_not_answer() -> None:
    """Issue 68 item 7: with a slow resolver the doctor said the scheduler `does not answer …
    fix: start the scheduler`. The name is looked up first, once per host, and is the finding,
    with the resolver's fix; the calls its failure would spoil are not made."""
    resolver = _Resolver(hangs="swarm.home.example")
    checks = diagnose(
        "cpu",
        FakeFacts(),
        broker="mqtts://swarm.home.example:8883",
        scheduler="swarm.home.example:50050",
        timeout=0.2,
        resolver=resolver,
    )
    assert resolver.asked == ["swarm.home.example"]  # one host, one lookup
    found = {c.name: c for c in checks}
    assert [c.name for c in checks] == ["torch", "device", "name", "broker", "scheduler"]
    assert "swarm.home.example did not resolve within 0.2 s" in found["name"].found
    assert "resolver" in found["name"].fix
    for call in ("broker", "scheduler"):
        assert found[call].found.startswith("not asked: its host's name did not resolve")
        assert "start the" not in found[call].fix, found[call]
    unknown = diagnose(
        "cpu", FakeFacts(), scheduler="shed.example:50050", timeout=0.2, resolver=resolver
    )
    (name,) = [c for c in unknown if c.name == "name"]
    assert "shed.example does not resolve" in name.found and "check the host name" in name.fix


def test_the_doctor_picks_the_device_and_an_invite_names_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 68 item 8: the invite's next step said `--device cuda:0`, even to a CPU-only
    friend. It names no device; the doctor's `--device auto` (its default) picks one and says
    which: the GPU this torch runs on with the most free memory, else the CPU."""
    busy, free, old = Gpu(free=10 * GiB), Gpu(free=70 * GiB), Gpu(name="old", capability=(3, 5))
    for facts, picked in [
        (FakeFacts(cuda=None), "cpu"),
        (FakeFacts(gpus=[busy, free]), "cuda:1"),
        (FakeFacts(gpus=[old]), "cpu"),  # no kernels for it: not picked
    ]:
        (device,) = [c for c in diagnose("auto", facts) if c.name == "device"]
        assert device.ok and f"(picked: serve with --device {picked})" in device.found
        assert device.found.startswith(picked)
    parser = argparse.ArgumentParser()
    invite.add_arguments("invite", parser)
    out = tmp_path / "bob.invite.json"
    (tmp_path / "token").write_text("t")
    flags = [
        "--broker",
        "mqtt://h:1883",
        "--scheduler",
        "h:1",
        "--token-file",
        str(tmp_path / "token"),
    ]
    args = parser.parse_args(["bob", "--out", str(out), *flags])
    assert invite.run("invite", args) == 0
    said = capsys.readouterr().out
    assert f"swarm doctor --join {out.name}" in said and "cuda" not in said
