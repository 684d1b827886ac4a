"""`swarm broker-config`: its ACL grants what the shipped one and the embedded broker grant, its
password file (hashed here or by mosquitto_passwd) lets real Mosquitto check the logins, and it
refuses what would make a broker that cannot start or cannot be logged in to."""

from __future__ import annotations

import base64
import os
import pwd
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.bus import broker_config
from swarm.bus.broker_config import TOOL_USER, acl_text, conf_text, hash_password, write
from swarm.bus.topics import SCHEDULER_USER, Topics, topic_matches
from swarm.cli import main
from swarm.errors import ConfigError
from tests.support.brokers import BUNDLED_ACL, reachable_dir
from tests.support.buses import WAIT_S, check_logins, login
from tests.support.cli import ROOT
from tests.support.mosquitto import ME, SCHEDULER_TOKEN, TOKEN, written_mosquitto

pytestmark = pytest.mark.timeout(60)

TOPICS = Topics()
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files given to mosquitto)")


# ----------------------------------------------------------------------------- the rules


def _grants(acl: str, user: str) -> list[tuple[str, str]]:
    """(access, topic filter) that Mosquitto's ACL file `acl` gives `user`."""
    grants, current = [], None
    for line in acl.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user":
            current = words[1]
        elif words[0] == "pattern":
            grants.append((words[1], words[2].replace("%u", user)))
        elif words[0] == "topic" and current == user:
            grants.append((words[1], words[2]))
    return grants


def _allowed(grants: list[tuple[str, str]], access: str, topic: str) -> bool:
    """As Mosquitto decides: a `deny` that matches first, whatever grants it."""
    if any(a == "deny" and topic_matches(topic, f) for a, f in grants):
        return False
    return any(a in (access, "readwrite") and topic_matches(topic, f) for a, f in grants)


def test_a_login_that_is_no_peer_publishes_no_peers_topics() -> None:
    """The tools' user and each trainer's log in with the swarm token: under the pattern every
    login had, any token holder without a peer password (a peer banned where peers each have
    one, say) announced itself as a peer under one of those names and was placed."""
    written = acl_text(["a"], trainers=["t1"])
    for user in (TOOL_USER, "t1"):
        for topic in (TOPICS.peer(user), TOPICS.load(user)):
            assert not _allowed(_grants(written, user), "write", topic), (user, topic)
            assert not _allowed(_grants(BUNDLED_ACL.read_text(), TOOL_USER), "write", topic)
    assert not TOPICS.may_publish(TOOL_USER, TOPICS.peer(TOOL_USER))
    assert _allowed(_grants(written, "a"), "write", TOPICS.peer("a"))  # a peer its own
    assert _allowed(_grants(written, "a"), "write", TOPICS.load("a"))
    assert not _allowed(_grants(written, "a"), "write", TOPICS.peer("b"))


def test_the_acl_grants_what_the_shipped_acl_and_the_embedded_broker_grant() -> None:
    peers = ["a", "b"]
    written, shipped = acl_text(peers), BUNDLED_ACL.read_text()
    assert "pattern read" not in written  # Mosquitto 2 warns at every start about it
    probes = [
        *(TOPICS.peer(p) for p in (*peers, "c", TOOL_USER, SCHEDULER_USER)),
        *(TOPICS.load(p) for p in (*peers, "c")),
        *(f"{TOPICS.prefix}jobs/j/load/{p}" for p in peers),  # the load topics of before (N3)
        *(f"{TOPICS.peer(p)}/x" for p in peers),
        *(TOPICS.reachability(p) for p in (*peers, "c")),  # a peer reads its own only
        TOPICS.job("j"),
        TOPICS.assign("j", "a"),
        TOPICS.steps("j"),
        "elsewhere/peers/a",
    ]
    for user in (SCHEDULER_USER, TOOL_USER, *peers):
        ours, theirs = _grants(written, user), _grants(shipped, user)
        for topic in probes:
            for access in ("read", "write"):
                expected = _allowed(theirs, access, topic)
                assert _allowed(ours, access, topic) == expected, (user, access, topic)
            if topic.startswith(TOPICS.prefix):  # outside it the embedded broker lets all be
                assert _allowed(ours, "write", topic) == TOPICS.may_publish(user, topic), topic
            if topic.startswith(TOPICS.prefix) and "/x" not in topic and "/load/" not in topic:
                # the swarm's own topics (the others the embedded broker lets every user read)
                assert _allowed(ours, "read", topic) == TOPICS.may_read(user, topic), topic


def test_the_shipped_conf_is_what_broker_config_writes() -> None:
    """examples/mosquitto/mosquitto.conf is an example of the output, kept from drifting."""
    example = conf_text(Path("/etc/swarm/broker"), 8883, user="mosquitto", mutual=False)
    assert (ROOT / "examples" / "mosquitto" / "mosquitto.conf").read_text() == example


def test_hash_password_is_mosquitto_passwds_format(tmp_path: Path) -> None:
    """The same salt gives mosquitto_passwd's line (its salt read back from its own file)."""
    made = tmp_path / "passwd"
    made.write_text(f"a:{TOKEN}\n")
    subprocess.run([broker_config.MOSQUITTO_PASSWD, "-U", str(made)], check=True)
    theirs = made.read_text().strip().split(":", 1)[1]
    salt = base64.b64decode(theirs.split("$")[3])
    assert hash_password(TOKEN, salt) == theirs
    assert hash_password(TOKEN) != hash_password(TOKEN)  # a fresh salt each time


# ----------------------------------------------------------------- against real Mosquitto


@pytest.fixture
def open_dir() -> Iterator[Path]:
    with reachable_dir() as path:
        yield path


@pytest.mark.parametrize("tool", ["mosquitto_passwd", "ours"])
async def test_real_mosquitto_checks_the_written_logins(
    tmp_path: Path, broker_certs: Path, tool: str
) -> None:
    hasher = broker_config.MOSQUITTO_PASSWD if tool == "mosquitto_passwd" else None
    with written_mosquitto(tmp_path, broker_certs, {"a": None, "b": "b-only"}, tool=hasher) as m:
        url = m.url
        await check_logins(url, "a", TOKEN, SCHEDULER_TOKEN)
        own = url.replace("mqtts://", "mqtts://b:b-only@")  # b's own password, in its URL
        async with login(own, "b", TOKEN) as b:
            await b.wait_connected(WAIT_S)
        async with login(url, TOOL_USER, TOKEN) as trainer:
            await trainer.wait_connected(WAIT_S)


async def test_a_started_tls_broker_has_had_no_connection_but_its_clients(
    tmp_path: Path, broker_certs: Path
) -> None:
    """The tests wait for a Mosquitto they start by its own word that it runs, not by dialling
    its TLS port: a dial closed before its handshake was logged, now and then, as an OpenSSL
    error ("unexpected eof while reading", "Protocol error"), and a test that reads the broker's
    log for errors (tests/system/test_deployment_docs.py) failed one run in many. One login,
    logged after whatever came before it: the only connection the broker saw."""
    with written_mosquitto(tmp_path, broker_certs, {"a": None}) as m:
        async with login(m.url, "a", TOKEN) as a:
            await a.wait_connected(WAIT_S)
        said = m.log.read_text()
    # "New connection from ...", or "Client connection from ... failed: ...": ours alone
    assert " running" in said and said.lower().count("connection from") == 1, said


# ------------------------------------------------------------------------------ refusals


def _write(tmp_path: Path, certs: Path, **kw: object) -> list[Path]:
    args: dict[str, object] = dict(
        certs=certs,
        cert="broker",
        port=8883,
        peers={"a": None},
        token=TOKEN,
        scheduler_password=SCHEDULER_TOKEN,
        user=ME,
        tool=None,
    )
    return write(tmp_path / "broker", **{**args, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"peers": {"a/b": None}}, "cannot be a peer id"),
        ({"peers": {SCHEDULER_USER: None}}, "cannot be a peer id"),
        ({"peers": {TOOL_USER: None}}, "cannot be a peer id"),
        ({"peers": {"a": "two\nlines"}}, "one non-empty line"),
        ({"scheduler_password": TOKEN}, "must not be the swarm token"),
        ({"cert": "missing"}, "missing"),
        ({"port": 0}, "TCP port"),
        ({"trainers": ["a"]}, "cannot be a trainer's user"),  # a peer id
        ({"trainers": [TOOL_USER]}, "cannot be a trainer's user"),
        ({"trainers": ["t/1"]}, "cannot be a trainer's user"),
        ({"trainers": ["t1", "t1"]}, "named twice"),
        ({"memory_limit_mib": 1}, "at least 16"),
    ],
)
def test_refuses_what_would_not_work(
    tmp_path: Path, broker_certs: Path, change: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        _write(tmp_path, broker_certs, **change)
    assert not (tmp_path / "broker" / "passwd").exists()


@as_root
def test_gives_the_secrets_to_the_brokers_user_in_a_place_it_can_reach(
    tmp_path: Path, broker_certs: Path, open_dir: Path
) -> None:
    """tmp_path lies under a 0700 directory of root's: Mosquitto, once it is user mosquitto,
    could not open its files there."""
    with pytest.raises(ConfigError, match="cannot enter"):
        _write(tmp_path, broker_certs, user="mosquitto")
    with pytest.raises(ConfigError, match="no user"):
        _write(open_dir, broker_certs, user="no-such-user-here")
    mosquitto = pwd.getpwnam("mosquitto")
    files = {f.name: f for f in _write(open_dir, broker_certs, user="mosquitto")}
    for name in ("passwd", "acl", "broker.key"):
        st = files[name].stat()
        assert (st.st_uid, st.st_mode & 0o777) == (mosquitto.pw_uid, 0o600), name
    assert files["mosquitto.conf"].stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- the command


def _verifies(passwd: Path, user: str, password: str) -> bool:
    """Whether `passwd` (Mosquitto's password file) holds `password` for `user`."""
    lines = dict(line.split(":", 1) for line in passwd.read_text().splitlines())
    salt = base64.b64decode(lines[user].split("$")[3])
    return hash_password(password, salt) == lines[user]


def test_the_command_makes_up_the_tokens_it_is_not_given_and_shows_them_once(
    tmp_path: Path,
    broker_certs: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SWARM_TOKEN", raising=False)
    monkeypatch.delenv("SWARM_SCHEDULER_TOKEN", raising=False)
    peers = tmp_path / "peers"
    peers.write_text("# the lab's machines\ngpu1\ngpu2 gpu2-own-pass\n\n")
    out = tmp_path / "broker"
    argv = ["broker-config", "--dir", str(out), "--certs", str(broker_certs), "--user", ME]
    assert main([*argv, "--peers", "gpu0", "--peers-file", str(peers), "--trainers", "t1"]) == 0
    printed = capsys.readouterr().out
    made = dict(re.findall(r"export (SWARM_\w+)=(\w+)", printed))
    assert set(made) == {"SWARM_TOKEN", "SWARM_SCHEDULER_TOKEN"}
    passwd = out / "passwd"
    for user in ("gpu0", "gpu1", TOOL_USER, "t1"):
        assert _verifies(passwd, user, made["SWARM_TOKEN"]), user
    assert "user t1\ntopic read swarm/v1/jobs/#" in (out / "acl").read_text()  # it reads, only
    assert "t1/reachability" not in (out / "acl").read_text()  # not a peer: no report of its own
    assert _verifies(passwd, "gpu2", "gpu2-own-pass")
    assert _verifies(passwd, SCHEDULER_USER, made["SWARM_SCHEDULER_TOKEN"])
    assert made["SWARM_TOKEN"] not in "".join(f.read_text() for f in out.iterdir())

    # Given, they are not printed; a peer named twice is a mistake.
    monkeypatch.setenv("SWARM_TOKEN", TOKEN)
    monkeypatch.setenv("SWARM_SCHEDULER_TOKEN", SCHEDULER_TOKEN)
    assert main([*argv, "--peers", "gpu0"]) == 0
    assert "export" not in capsys.readouterr().out
    assert _verifies(passwd, "gpu0", TOKEN) and "gpu1:" not in passwd.read_text()
    assert main([*argv, "--peers", "gpu1", "--peers-file", str(peers)]) == 2
    assert "gpu1 is named twice" in capsys.readouterr().err
