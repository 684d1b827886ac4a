"""`swarm broker-config`: Mosquitto's files for a swarm, ready to run as written: its configuration
(absolute paths, the TLS listener, a client's id bound to its user, caps on what clients make the
broker hold), the password file (the scheduler's own password; the swarm token, or a password of
its own, for each peer id chosen up front; the token for each trainer's user) and the ACL.

The ACL's rules are `examples/mosquitto/acl`'s (and the embedded broker's, `Topics.may_publish`),
with one difference of form: Mosquitto 2 warns at every start about a `pattern` line without `%u`
or `%c`, so "everyone reads the swarm" is a `topic read` line under each user it lets in.

Ownership: started as root, Mosquitto drops to the user its configuration names before it reads
the password file, the ACL and its TLS key, so they belong to that user, mode 0600 (later
Mosquittos also refuse such files owned by another). The broker's certificate and key are copied
into the directory for that, so the certificate directory (it may hold the CA's key) stays closed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from swarm.bus.flags import scheduler_token
from swarm.bus.topics import DEFAULT_PREFIX, SCHEDULER_USER, TOOL_USER
from swarm.errors import ConfigError
from swarm.flags import add_secret, add_token, env_name, token
from swarm.net.tls import Tls

__all__ = [
    "TOOL_USER",
    "acl_text",
    "add_arguments",
    "conf_text",
    "hash_password",
    "passwd_text",
    "run",
    "write",
]

CONF, PASSWD, ACL, CA = "mosquitto.conf", "passwd", "acl", "ca.pem"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
_ID = re.compile(r"[A-Za-z0-9._-]+")  # the characters of a persisted peer id (stage_server)
_ITERATIONS = 101  # mosquitto_passwd's, for PBKDF2-SHA512 (`$7$`)
MEMORY_LIMIT_MIB = 512  # the broker's whole heap; a swarm's retained state is a few MiB
# Over every retained message of a full swarm (1,024 peers' announcements and assignments, the
# jobs), which a fresh subscription to all of them is sent at once: Mosquitto counts each.
MAX_QUEUED_MESSAGES = 4096
MAX_QUEUED_BYTES = 64 << 20


def conf_text(
    directory: Path,
    port: int,
    *,
    user: str,
    mutual: bool,
    cert: str = "broker",
    memory_limit_mib: int = MEMORY_LIMIT_MIB,
) -> str:
    """mosquitto.conf for the files `write` puts in `directory` (absolute)."""
    d = directory
    return f"""\
# Mosquitto 2 for a swarm, written by `swarm broker-config` (run it again to change anything).
# Start it as root (it becomes user {user}, which owns the key, {PASSWD} and {ACL}):
#   mosquitto -c {d / CONF}
# After adding peers, `kill -HUP` it: it reads {PASSWD} and {ACL} again.
user {user}

# What a stranger can take: packets up to 2 MiB (a job announcement carries its job file, at
# most 1 MiB), a larger one closes its connection; the embedded broker's defaults.
max_packet_size 2097152
# Retained state is refilled by the clients after a restart (they re-publish it).
persistence false
# What one client makes the broker hold: what is not yet sent to it (a subscriber that never
# reads) is dropped for it past max_queued_messages (QoS 0 messages are counted) or
# max_queued_bytes (QoS 1). A fresh subscription is sent every retained message at once: a full
# swarm has fewer.
max_queued_messages {MAX_QUEUED_MESSAGES}
max_queued_bytes {MAX_QUEUED_BYTES}
# All of the broker's heap, retained messages included: past it a message is dropped and its
# sender disconnected. Mosquitto bounds no one user's retained bytes, but a peer writes two
# topics only (acl), so it holds at most two retained messages of max_packet_size.
memory_limit {memory_limit_mib << 20}

# TLS with the swarm's CA only: clients dial mqtts://HOST:{port} with --tls-ca.
listener {port}
max_connections 1024
cafile {d / CA}
certfile {d / f"{cert}.pem"}
keyfile {d / f"{cert}.key"}
require_certificate {"true" if mutual else "false"}
# With require_certificate true, `use_identity_as_username true` would make a client's
# certificate name its user: issue the scheduler's as scheduler, each peer's as its id.

# Who may log in: "scheduler" with a password of its own, each peer id with the swarm token or
# its own password, each trainer's user and "{TOOL_USER}" (tools) with the token; each publishes
# only its own. A client's id is its user, whatever id it sends: no one takes the scheduler's
# or another peer's place (the same user logging in again replaces its own connection).
allow_anonymous false
use_username_as_clientid true
password_file {d / PASSWD}
acl_file {d / ACL}
"""


def acl_text(
    peers: Iterable[str], prefix: str = DEFAULT_PREFIX, trainers: Iterable[str] = ()
) -> str:
    """The ACL for the scheduler, `TOOL_USER`, `peers` (usernames are peer ids) and `trainers`
    (users that read the swarm, one for each trainer)."""
    every = f"{prefix}#"
    lines = [
        "# The swarm's ACL, written by `swarm broker-config`: each peer publishes only its own",
        "# topics (a denied PUBLISH, a last-will included, is dropped silently): its announcement",
        "# (and last-will) and its load reports (of whichever job it serves: a fixed two topics,",
        "# so it can leave no more than two retained), written under its own user below; no",
        "# `pattern write`, which every login has: the tools' and the trainers' users log in with",
        "# the swarm token, and any token holder would announce itself as a peer under those.",
        "",
        "# The scheduler: job announcements, assignments, committed steps, and anything else.",
        f"user {SCHEDULER_USER}",
        f"topic readwrite {every}",
        "",
        "# Everyone reads the whole swarm but the scheduler's reachability reports, which only",
        "# the scheduler and the peer dialled back read (Mosquitto's `deny` would hide a peer's",
        "# own too: it is checked before every grant).",
    ]
    reads = [f"topic read {prefix}{t}" for t in ("jobs/#", "peers/+", "peers/+/load")]
    for user in (TOOL_USER, *trainers):
        lines += [f"user {user}", *reads]
    # (as the shipped ACL must, which grants peers' writes by pattern to every login: the tools'
    # user is no peer, and nothing of a peer of its name is written or read)
    at = lines.index(f"user {TOOL_USER}") + 1
    lines[at:at] = [
        f"topic deny {prefix}peers/{TOOL_USER}",
        f"topic deny {prefix}peers/{TOOL_USER}/load",
    ]
    for user in peers:
        lines += [f"user {user}", *reads, f"topic read {prefix}peers/{user}/reachability"]
        lines += [f"topic write {prefix}peers/{user}", f"topic write {prefix}peers/{user}/load"]
    return "\n".join(lines) + "\n"


def hash_password(password: str, salt: bytes | None = None) -> str:
    """`password` as mosquitto_passwd hashes it: `$7$ITERATIONS$SALT$PBKDF2-SHA512`, base64."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    key = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _ITERATIONS)
    b64 = base64.b64encode
    return f"$7${_ITERATIONS}${b64(salt).decode()}${b64(key).decode()}"


def passwd_text(logins: Mapping[str, str], tool: str | None = MOSQUITTO_PASSWD) -> str:
    """The password file: Mosquitto's own tool hashes it when present (`-U`, from a private
    file: `-b` would show every password in `ps`), else `hash_password` does."""
    plain = "".join(f"{user}:{password}\n" for user, password in logins.items())
    if tool is None or not Path(tool).exists():
        return "".join(f"{user}:{hash_password(pw)}\n" for user, pw in logins.items())
    with tempfile.TemporaryDirectory() as private:  # 0700
        path = Path(private) / PASSWD
        path.touch(mode=0o600)
        path.write_text(plain)
        done = subprocess.run([tool, "-U", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"{tool} -U failed: {done.stderr.strip() or done.stdout.strip()}")
        return path.read_text()


def write(
    directory: Path,
    *,
    certs: Path,
    cert: str,
    port: int,
    peers: Mapping[str, str | None],
    token: str,
    scheduler_password: str,
    user: str,
    mutual: bool = False,
    tool: str | None = MOSQUITTO_PASSWD,
    trainers: Iterable[str] = (),
    memory_limit_mib: int = MEMORY_LIMIT_MIB,
) -> list[Path]:
    """Write Mosquitto's files into `directory`; return them. `peers` maps each peer id to its
    own password, or None: the swarm `token` (which `TOOL_USER` and `trainers` log in with too).
    Mosquitto makes a client's id its user, so each trainer needs a user of its own: two
    connections of one user take each other's place."""
    trainers = list(trainers)
    if scheduler_password == token:
        raise ConfigError("the scheduler's password must not be the swarm token: every peer has it")
    for peer, password in {TOOL_USER: token, **peers}.items():
        if password is None:
            continue
        if not password or "\n" in password:
            raise ConfigError(f"{peer}: a password is one non-empty line")
    for peer in peers:
        if not _ID.fullmatch(peer) or peer in (SCHEDULER_USER, TOOL_USER):
            raise ConfigError(
                f"{peer!r} cannot be a peer id: use letters, digits, '.', '_' and '-', and "
                f"neither {SCHEDULER_USER!r} nor {TOOL_USER!r}"
            )
    for trainer in trainers:
        if not _ID.fullmatch(trainer) or trainer in (SCHEDULER_USER, TOOL_USER, *peers):
            raise ConfigError(
                f"{trainer!r} cannot be a trainer's user: use letters, digits, '.', '_' and '-', "
                f"and neither {SCHEDULER_USER!r}, {TOOL_USER!r} nor a peer id"
            )
    if len(set(trainers)) != len(trainers):
        raise ConfigError("a trainer's user is named twice")
    if memory_limit_mib < 16:
        raise ConfigError(f"--memory-limit is in MiB, at least 16, got {memory_limit_mib}")
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be a TCP port, got {port}")
    ca, pem, key = certs / CA, certs / f"{cert}.pem", certs / f"{cert}.key"
    Tls.load(ca, pem, key, False)  # issued by the CA, unexpired, matching its key
    owner = _owner(user)
    directory = directory.absolute()
    _make_dirs(directory)
    if owner is not None:
        _check_reachable(directory, user)
    logins = {SCHEDULER_USER: scheduler_password, TOOL_USER: token}
    logins |= {peer: password or token for peer, password in peers.items()}
    logins |= {trainer: token for trainer in trainers}
    conf = conf_text(
        directory, port, user=user, mutual=mutual, cert=cert, memory_limit_mib=memory_limit_mib
    )
    files = {
        CONF: (conf, 0o644, None),
        PASSWD: (passwd_text(logins, tool), 0o600, owner),
        ACL: (acl_text(peers, trainers=trainers), 0o600, owner),
        CA: (ca.read_text(), 0o644, None),
        pem.name: (pem.read_text(), 0o644, None),
        key.name: (key.read_text(), 0o600, owner),
    }
    for name, (text, mode, own) in files.items():
        _write(directory / name, text, mode, own)
    return [directory / name for name in files]


def _owner(user: str) -> tuple[int, int] | None:
    """The (uid, gid) the broker's secrets get: `user`'s, as root; None (ours) otherwise."""
    me = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() != 0:
        if user != me:
            raise ConfigError(
                f"only root can give the files to {user!r}: run as root, or --user {me}"
            )
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(
            f"no user {user!r} here: install Mosquitto (its package makes the user mosquitto), "
            "or name the user it runs as with --user"
        ) from None
    return entry.pw_uid, entry.pw_gid


def _make_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents 0755, whatever the umask: the broker's user
    must pass through them."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir()
        p.chmod(0o755)


def _check_reachable(directory: Path, user: str) -> None:
    """Refuse a directory that `user` cannot reach (one under /root, say): Mosquitto would start
    and fail on its first file."""
    entry = pwd.getpwnam(user)
    groups = {entry.pw_gid, *os.getgrouplist(user, entry.pw_gid)}
    for p in (directory, *directory.parents):
        st = p.stat()
        bit = 0o100 if st.st_uid == entry.pw_uid else 0o010 if st.st_gid in groups else 0o001
        if not st.st_mode & bit:
            raise ConfigError(
                f"user {user} (Mosquitto, once started) cannot enter {p}: choose a --dir it can "
                f"reach, e.g. /etc/swarm/broker"
            )


def _write(path: Path, text: str, mode: int, owner: tuple[int, int] | None) -> None:
    """Replace `path` whole, already with its mode and owner (never readable by others first)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, *owner)
        f.write(text)
        f.flush()
        os.fsync(fd)
    os.replace(tmp, path)


# The command.


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, required=True, help="where to write Mosquitto's files")
    p.add_argument("--peers", default="", help="peer ids that may log in, comma-separated")
    p.add_argument(
        "--peers-file",
        type=Path,
        help="more peer ids, one a line: 'ID' logs in with the token, 'ID PASSWORD' with its own "
        "(# starts a comment line)",
    )
    p.add_argument(
        "--trainers",
        default="",
        help="users for trainers, comma-separated (password: the token): Mosquitto makes a "
        "client's id its user, so each trainer process dials mqtts://USER@HOST:PORT with one of "
        f"its own; {TOOL_USER!r} serves one connection at a time",
    )
    p.add_argument(
        "--memory-limit",
        type=int,
        default=MEMORY_LIMIT_MIB,
        metavar="MIB",
        help="all of Mosquitto's heap, retained messages included, in MiB (past it a message is "
        "dropped and its sender disconnected)",
    )
    p.add_argument(
        "--certs",
        type=Path,
        default=Path("certs"),
        help="the directory of ca.pem and the broker's certificate (`swarm certs --dir`)",
    )
    p.add_argument("--cert", default="broker", help="the broker's certificate (NAME.pem/.key)")
    p.add_argument("--port", type=int, default=8883, help="the TLS listener's port")
    p.add_argument(
        "--user", help="the user Mosquitto runs as (default: mosquitto as root, else you)"
    )
    add_token(p, "the swarm token, every peer's password (default: SWARM_TOKEN, else made up)")
    add_secret(  # and --scheduler-token-file, as every secret flag has
        p,
        "scheduler-token",
        "the scheduler's own password (default: SWARM_SCHEDULER_TOKEN, else made up)",
    )
    p.add_argument(
        "--tls-mutual",
        action="store_true",
        default=os.environ.get(env_name("tls-mutual"), "").lower() in ("1", "true", "yes"),
        help=f"require a client certificate of the CA [env {env_name('tls-mutual')}]",
    )


def run(command: str, args: argparse.Namespace) -> int:
    made: list[str] = []
    swarm_token = token(args)
    if swarm_token is None:
        swarm_token = secrets.token_hex(32)
        made.append(f"export SWARM_TOKEN={swarm_token}  # every peer, trainer and the scheduler")
    sched = scheduler_token(args)
    if sched is None:
        sched = secrets.token_hex(32)
        made.append(f"export SWARM_SCHEDULER_TOKEN={sched}  # the scheduler alone")
    peers = _peers(args.peers, args.peers_file)
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    user = args.user or ("mosquitto" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name)
    files = write(
        args.dir,
        certs=args.certs,
        cert=args.cert,
        port=args.port,
        peers=peers,
        token=swarm_token,
        scheduler_password=sched,
        user=user,
        mutual=args.tls_mutual,
        trainers=trainers,
        memory_limit_mib=args.memory_limit,
    )
    also = f", trainers {', '.join(trainers)}" if trainers else ""
    print(
        f"wrote {', '.join(str(f) for f in files)}: {SCHEDULER_USER}, {TOOL_USER} and "
        f"{len(peers)} peers ({', '.join(peers)}){also} may log in; the secrets belong to {user}\n"
        f"start it: mosquitto -c {files[0]}"
        + (f" (as root: it becomes {user})" if os.geteuid() == 0 else "")
    )
    if made:
        print(
            "made up (shown this once; the password file keeps only hashes):\n  "
            + "\n  ".join(made)
        )
    return 0


def _peers(listed: str, path: Path | None) -> dict[str, str | None]:
    """Peer id -> its own password or None (the token), from `--peers` then `--peers-file`."""
    entries: list[tuple[str, str | None]] = [(p.strip(), None) for p in listed.split(",")]
    entries = [e for e in entries if e[0]]
    if path is not None:
        for line in path.read_text().splitlines():
            fields = line.split(None, 1)
            if fields and not fields[0].startswith("#"):
                entries.append((fields[0], fields[1].strip() if len(fields) > 1 else None))
    if not entries:
        raise ConfigError("name the peers that may log in: --peers a,b,c or --peers-file FILE")
    peers: dict[str, str | None] = {}
    for peer, password in entries:
        if peer in peers:
            raise ConfigError(f"peer {peer} is named twice")
        peers[peer] = password
    return peers
