"""A friend joins from one file (issue 51, item 6): `swarm invite NAME` on the scheduler's host
writes the broker, the scheduler, the CA, a certificate for the peer id NAME, the swarm token and
NAME's submitter token; `--join FILE` uses them. `swarm doctor` logs in to the broker and calls the
scheduler for real: before, it only opened a TCP connection, and passed with a wrong token and
without TLS against this TLS-only swarm (`test_doctor_without_the_swarms_credentials_fails`
failed on the old code). A real scheduler process with its embedded broker, TLS and a token."""

from __future__ import annotations

import argparse
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from stage_server.peer.network_checks import path_check
from swarm.errors import ConfigError
from swarm.local.procs import SwarmProcess, start_process
from swarm.net import invite
from swarm.net.addresses import peer_host
from swarm.net.certs import init_ca, issue
from tests.support.cli import swarm
from tests.support.waiting import wait_until_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN, ADMIN = "the-swarm-token", "the-admin-token"


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SwarmProcess]:
    """A scheduler on loopback with TLS (its broker `mqtts://` only), a token and an admin."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue(certs, "scheduler", ["127.0.0.1", "localhost"])
    data = tmp_path / "data"
    data.mkdir()
    env = {
        "SWARM_TOKEN": TOKEN,
        "SWARM_ADMIN_TOKEN": ADMIN,
        "SWARM_TLS_CA": str(certs / "ca.pem"),
        "SWARM_TLS_CERT": str(certs / "scheduler.pem"),
        "SWARM_TLS_KEY": str(certs / "scheduler.key"),
    }
    args = ["scheduler", "--port", "0", "--store", str(tmp_path / "jobs.sqlite")]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--data-root", str(data)]
    proc = start_process(args, log_dir=tmp_path, name="scheduler", env=env)
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The friend's machine: none of the swarm's variables, a cache directory of its own."""
    for name in [n for n in os.environ if n.startswith("SWARM_")]:
        monkeypatch.delenv(name)
    return {"SWARM_CACHE_DIR": str(tmp_path / "friend-cache")}


def _invite(tmp_path: Path, scheduler: SwarmProcess) -> Path:
    out = tmp_path / "alice.invite.json"
    swarm(
        *("invite", "alice", "--ca-dir", str(tmp_path / "certs"), "--out", str(out)),
        *("--broker", scheduler.ready["broker"], "--scheduler", scheduler.address),
        env={"SWARM_TOKEN": TOKEN, "SWARM_ADMIN_TOKEN": ADMIN},
        timeout=60,
    )
    return out


def test_an_invite_holds_everything_and_doctor_logs_in_with_it(
    tmp_path: Path, scheduler: SwarmProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _invite(tmp_path, scheduler)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    doc = json.loads(out.read_text())
    assert doc["kind"] == "swarm-invite" and doc["version"] == 1
    assert doc["broker"].startswith("mqtts://") and doc["token"] == TOKEN
    assert doc["submitter_token"].startswith("alice:")
    cert = x509.load_pem_x509_certificate(doc["cert"].encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    # the peer id and a second machine's (gpu1.alice), no host name (`swarm.net.peer_names`)
    assert sorted(names) == ["*.alice.peer.swarm", "alice.peer.swarm"]

    env = _clean_env(tmp_path, monkeypatch)
    done = swarm("doctor", "--join", str(out), env=env, timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   broker: " in done.stdout and "accepted the login as alice, over TLS" in done.stdout
    assert "ok   scheduler: " in done.stdout and "answered an authenticated call" in done.stdout
    assert "ok   path: direct" in done.stdout, done.stdout
    unpacked = tmp_path / "friend-cache" / "join" / "alice"
    for name in ("ca.pem", "alice.pem", "alice.key", "token", "submitter-token"):
        assert stat.S_IMODE((unpacked / name).stat().st_mode) == 0o600, name

    # The job commands take it too: the friend's submitter token and the swarm's.
    jobs = swarm("jobs", "--join", str(out), env=env, timeout=60, check=False)
    assert jobs.returncode == 0, jobs.stdout + jobs.stderr

    # An invite whose token is not the swarm's: both the broker and the scheduler refuse it.
    wrong = tmp_path / "wrong.invite.json"
    wrong.write_text(json.dumps({**doc, "token": "not-the-token"}))
    done = swarm("doctor", "--join", str(wrong), env=env, timeout=90, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL broker: " in done.stdout and "refused the login as alice" in done.stdout
    assert "FAIL scheduler: " in done.stdout and "refused the swarm token" in done.stdout
    assert "fix: use the swarm's token" in done.stdout


def test_doctor_without_the_swarms_credentials_fails(
    tmp_path: Path, scheduler: SwarmProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: both passed, the ports being open."""
    env = _clean_env(tmp_path, monkeypatch)
    broker, address = scheduler.ready["broker"], scheduler.address
    done = swarm("doctor", "--broker", broker, "--scheduler", address, env=env, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL broker: " in done.stdout and "FAIL scheduler: " in done.stdout, done.stdout


def test_a_stage_server_joins_with_the_invite(
    tmp_path: Path, scheduler: SwarmProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _invite(tmp_path, scheduler)
    env = _clean_env(tmp_path, monkeypatch)
    peer = start_process(
        ["stage-server", "--join", str(out), "--device", "cpu"],
        log_dir=tmp_path,
        name="alice",
        env=env,
    )
    try:
        ready = peer.wait_ready(90)
        # An invite without --host: behind NAT, attached to a relay from its start, no flag given.
        wait_until_blocking(lambda: "behind NAT" in peer.log(), "the peer says it is behind NAT")
    finally:
        peer.stop()
    assert ready["peer"] == "alice", ready
    assert "Traceback" not in peer.log(), peer.log()


def test_join_refuses_a_flag_given_twice_and_a_foreign_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "x.invite.json"
    invite.write(invite.Invite("bob", "mqtt://h:1883", "h:7700", token="t"), path)
    args = argparse.Namespace(join=path, peer="", broker="mqtt://h:1883", token=None)
    args.token_file, args.command = None, "stage-server"
    assert invite.apply_join(args) is not None and args.peer == "bob"
    assert Path(args.token_file).read_text() == "t\n"
    args.join, args.peer, args.token_file = path, "gpu1.bob", None  # a second GPU's process
    invite.apply_join(args)
    assert args.peer == "gpu1.bob"
    for given in ({"broker": "mqtt://elsewhere:1883"}, {"token": "mine"}, {"peer": "carol"}):
        args = argparse.Namespace(join=path, peer="", broker="", token=None, token_file=None)
        args.command = "stage-server"
        vars(args).update(given)
        with pytest.raises(ConfigError, match="leave out --"):
            invite.apply_join(args)
    with pytest.raises(ConfigError, match="already exists"):
        invite.write(invite.Invite("bob", "mqtt://h:1883", "h:7700"), path)
    doc = json.loads(path.read_text())
    (tmp_path / "v9.json").write_text(json.dumps({**doc, "version": 9}))
    with pytest.raises(ConfigError, match="version 9; this swarm reads version 1"):
        invite.read(tmp_path / "v9.json")


def test_the_path_says_behind_nat_relayed_via_which_relay() -> None:
    relayed = path_check("192.168.1.10", "198.51.100.2", {"relay-vps": "203.0.113.5:7100"})
    assert relayed.ok and "behind NAT" in relayed.found
    assert "→ relayed via relay-vps (203.0.113.5:7100)" in relayed.found
    alone = path_check("192.168.1.10", "198.51.100.2", {})
    assert not alone.ok and "swarm relay" in alone.fix
    assert path_check("10.0.0.9", "10.0.0.9", {}).found.startswith("direct")
    assert peer_host("ipv4:198.51.100.2:4242") == "198.51.100.2"
    assert peer_host("ipv6:[::1]:4242") == peer_host("ipv6:%5B::1%5D:4242") == "::1"
    assert peer_host("unix:/tmp/s") == ""
