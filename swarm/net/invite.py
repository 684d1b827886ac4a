"""An invite: everything a friend's peer needs to join a swarm, in one file (`swarm invite NAME`),
and its use by any command that dials the swarm (`--join FILE`).

Without it a friend is sent five files by hand (the CA, a certificate and its key, the swarm token,
the metrics token) and told the broker's URL and the scheduler's address; and the certificate must
name an address that, behind NAT, nobody dials. The invite holds them all, in one JSON document
(versioned, written 0600: it holds the swarm token and a private key):
- `broker`, `scheduler`: where the friend's processes dial;
- `ca`: the swarm CA's certificate (PEM), when the swarm runs TLS;
- `cert`, `key`: a certificate for the peer ids NAME and `LABEL.NAME` (`swarm.net.peer_names`,
  the one rule of what an invite certifies: a relayed peer is verified by its peer id; a second
  process on the same invite, a second machine or GPU, takes `--peer gpu1.NAME`) and any
  `--host` given, issued by the swarm CA, and its key;
- `token`, `metrics_token`: the swarm's secrets (the metrics token if the swarm has one);
- `submitter_token`: NAME's submitter token when the scheduler has an admin token
  (`swarm.net.submitters`), so the friend may export the jobs they submit;
- `reached`: how callers reach the friend's peer: `relay` when the invite names no `--host` (the
  friend is behind NAT: `--join` attaches a stage server to a relay at its start, as
  `--behind-nat` does, so the friend gives no flag of NAT), `direct` with one ("" in an invite
  made before this field: nothing implied).

`--join FILE` reads it and fills the command's flags: the peer id, the broker, the scheduler, the
TLS files and the token files, and a stage server's `--behind-nat` when it is `relay`. The job's
data is not in it, nor at a shared path: a stage server reads none, and a trainer (`swarm trainer
--join FILE --job ID`) fetches it from the scheduler it names (`client.job_data`). The TLS code
and the MQTT library read paths, so the PEMs and the secrets are unpacked into
`<cache dir>/join/NAME/`, readable by their owner only; nothing secret goes on a command line.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from swarm.errors import ConfigError
from swarm.flags import add_flag, add_metrics_token, add_secret, add_token, metrics_token, secret
from swarm.flags import token as swarm_token
from swarm.net.certs import issue_pem, private_file
from swarm.net.peer_names import check_invite_name, invite_names, own_id
from swarm.net.submitters import check_submitter_name, submitter_token

__all__ = ["VERSION", "Invite", "add_join_flag", "apply_join", "make", "read", "unpack", "write"]

VERSION = 1
KIND = "swarm-invite"


@dataclass(frozen=True)
class Invite:
    """What one invite file holds; "" where the swarm has none (no TLS, no metrics token)."""

    name: str  # the friend's peer id, their certificate's name and their submitter name
    broker: str
    scheduler: str
    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = ""
    metrics_token: str = ""
    submitter_token: str = ""
    reached: str = ""  # RELAY or DIRECT; "": an older invite, which did not say


RELAY, DIRECT = "relay", "direct"


def make(
    name: str,
    broker: str,
    scheduler: str,
    *,
    ca_dir: Path | None,
    hosts: list[str],
    token: str | None,
    metrics_token: str | None = None,
    admin_token: str | None = None,
    days: int = 365,
) -> Invite:
    """The invite for peer `name`: with `ca_dir` (the swarm CA's directory) a certificate issued
    for `name` and `hosts`; with `admin_token` the submitter token that names `name`."""
    check_invite_name(name)  # one label, no authority's (a ConfigError that says why)
    check_submitter_name(name)  # the one alphabet peer ids, file names and submitters share
    if not broker:
        raise ConfigError("give --broker: the broker URL the friend's peer dials (mqtts://...)")
    if not scheduler:
        raise ConfigError("give --scheduler: the scheduler's HOST:PORT the friend dials")
    ca = cert = key = ""
    if ca_dir is not None:
        # The peer ids NAME and LABEL.NAME (a second process takes `--peer gpu1.NAME`), never
        # a host name of NAME's own: only the --host the admin gives.
        names = [*invite_names(name), *hosts]
        cert_pem, key_pem, _ = issue_pem(ca_dir, name, names, days)
        ca = (ca_dir / "ca.pem").read_text()
        cert, key = cert_pem.decode(), key_pem.decode()
    elif broker.startswith("mqtts://"):
        raise ConfigError(
            "the broker speaks TLS: give --ca-dir (the directory of `swarm certs init`), so the "
            "invite carries the CA and a certificate for the friend's peer"
        )
    return Invite(
        name,
        broker,
        scheduler,
        ca,
        cert,
        key,
        token or "",
        metrics_token or "",
        submitter_token(admin_token, name) if admin_token else "",
        DIRECT if hosts else RELAY,  # no address of the friend's to dial: behind NAT
    )


def write(invite: Invite, path: Path) -> None:
    """`path`, written whole and 0600; never over another file (an invite is one friend's)."""
    if path.exists():
        raise ConfigError(f"{path} already exists: choose another --out, or remove it first")
    document = {"kind": KIND, "version": VERSION, **asdict(invite)}
    private_file(path, (json.dumps(document, indent=2) + "\n").encode())


def read(path: Path) -> Invite:
    """The invite at `path`; a ConfigError naming what is wrong and who can fix it."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--join {path} cannot be read ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--join {path} is not an invite (not JSON: {e})") from None
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise ConfigError(f"--join {path} is not an invite: make one with `swarm invite NAME`")
    if document.get("version") != VERSION:
        raise ConfigError(
            f"--join {path} is an invite of version {document.get('version')!r}; this swarm "
            f"reads version {VERSION}: ask for a new one (`swarm invite NAME`), or update swarm"
        )
    values = {}
    for f in fields(Invite):
        value = document.get(f.name, "")
        if not isinstance(value, str):
            raise ConfigError(f"--join {path}: {f.name} is not text")
        values[f.name] = value
    invite = Invite(**values)
    check_submitter_name(invite.name)
    if invite.reached not in ("", RELAY, DIRECT):
        raise ConfigError(f"--join {path}: reached is {invite.reached[:16]!r}, not relay or direct")
    if not invite.broker or not invite.scheduler:
        raise ConfigError(f"--join {path} names no broker or no scheduler: ask for a new one")
    return invite


@dataclass(frozen=True)
class Unpacked:
    """The files an invite was unpacked into ("" where it held nothing of the kind)."""

    ca: Path | None
    cert: Path | None
    key: Path | None
    token: Path | None
    metrics_token: Path | None
    submitter_token: Path | None


def unpack(invite: Invite, directory: Path) -> Unpacked:
    """The invite's PEMs and secrets as files under `directory` (made 0700), each 0600."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)

    def put(file: str, text: str) -> Path | None:
        if not text:
            return None
        path = directory / file
        private_file(path, text.encode())
        return path

    return Unpacked(
        put("ca.pem", invite.ca),
        put(f"{invite.name}.pem", invite.cert),
        put(f"{invite.name}.key", invite.key),
        put("token", invite.token + "\n" if invite.token else ""),
        put("metrics-token", invite.metrics_token + "\n" if invite.metrics_token else ""),
        put("submitter-token", invite.submitter_token + "\n" if invite.submitter_token else ""),
    )


def cache_dir() -> Path:
    """Where a peer keeps what is its own (`SWARM_CACHE_DIR`, else ~/.cache/swarm)."""
    return Path(os.environ.get("SWARM_CACHE_DIR") or Path.home() / ".cache" / "swarm")


def add_join_flag(p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "join",
        None,
        "an invite file (`swarm invite NAME`): the peer id, broker, scheduler, TLS files and "
        "tokens it holds fill those flags",
        type=Path,
    )


# flag dest -> what of the unpacked invite fills it; a command fills those of its flags it has
_FILLS = {
    "peer": "name",
    "broker": "broker",
    "scheduler": "scheduler",
    "tls_ca": "ca",
    "tls_cert": "cert",
    "tls_key": "key",
    "token_file": "token",
    "metrics_token_file": "metrics_token",
    "submitter_token_file": "submitter_token",
}
# a secret's file flag -> the secret's own flag: given as well, it is a conflict too
_SECRETS = {
    "token_file": "token",
    "metrics_token_file": "metrics-token",
    "submitter_token_file": "submitter-token",
}


def apply_join(args: argparse.Namespace) -> Invite | None:
    """With `--join FILE`: the invite unpacked, its values in the command's flags. A flag given
    another value as well (on the command line or by its variable) is a ConfigError: which one
    counts would be a guess."""
    path = getattr(args, "join", None)
    if path is None:
        return None
    invite = read(path)
    files = unpack(invite, cache_dir() / "join" / invite.name)
    values: dict[str, object] = {
        **{f.name: getattr(files, f.name) for f in fields(Unpacked)},
        "name": invite.name,
        "broker": invite.broker,
        "scheduler": invite.scheduler,
    }
    for dest, key in _FILLS.items():
        value = values[key]
        if not hasattr(args, dest) or value is None:
            continue
        given = getattr(args, dest)
        if dest == "peer" and (own_id(given or "", invite.name) or args.command == "relay"):
            continue  # a second process's id under the invite's name; a relay's id is its own
        flag = _SECRETS.get(dest, dest.replace("_", "-"))
        secret_given = dest in _SECRETS and getattr(args, _SECRETS[dest].replace("-", "_"), None)
        if (given not in (None, "") and str(given) != str(value)) or secret_given:
            raise ConfigError(
                f"--join {path} gives --{flag} (or its file); leave out --{flag} and its "
                "environment variable, or leave out --join"
            )
        setattr(args, dest, value)
    if invite.reached == RELAY and hasattr(args, "behind_nat"):
        args.behind_nat = True  # a stage server: attached to a relay from its start
    return invite


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    """`swarm invite NAME`, run where the swarm CA and token are (the scheduler's host)."""
    p.add_argument(
        "name", help="the friend's peer id (also their certificate's and submitter name)"
    )
    p.add_argument("--out", type=Path, help="the invite file to write (default: NAME.invite.json)")
    add_flag(p, "broker", None, "the broker URL the friend's peer dials, e.g. mqtts://VPS:8883")
    add_flag(p, "scheduler", None, "the scheduler's job API the friend dials, HOST:PORT")
    add_flag(
        p,
        "ca-dir",
        None,
        "the swarm CA's directory (`swarm certs init --dir`): the invite carries the CA and a "
        "certificate for NAME (none: a swarm without TLS)",
        type=Path,
    )
    p.add_argument(
        "--host",
        action="append",
        default=[],
        help="an address the friend's peer is dialled at directly, also in its certificate "
        "(repeatable; behind NAT give none: the relay reaches it by its peer id, and its "
        "stage server attaches to a relay at its start, as with --behind-nat)",
    )
    p.add_argument("--days", type=int, default=365, help="the certificate's validity")
    add_token(p)
    add_metrics_token(p)
    add_secret(
        p,
        "admin-token",
        "the scheduler's admin token: the invite carries NAME's submitter token, so the friend "
        "may export the jobs they submit (default: SWARM_ADMIN_TOKEN; none: no submitter token)",
    )


def run(command: str, args: argparse.Namespace) -> int:
    out = args.out or Path(f"{args.name}.invite.json")
    invite = make(
        args.name,
        args.broker or "",
        args.scheduler or "",
        ca_dir=args.ca_dir,
        hosts=args.host,
        token=swarm_token(args),
        metrics_token=metrics_token(args),
        admin_token=secret(args, "admin-token"),
        days=args.days,
    )
    write(invite, out)
    nat = (
        "\nNo --host: their peer is behind NAT, and attaches to a relay at its start"
        if invite.reached == RELAY
        else ""
    )
    print(
        f"wrote {out} (0600: it holds the swarm token{' and a private key' if invite.key else ''})"
        f"; send it to {args.name} privately. They run:\n"
        f"  swarm doctor --join {out.name}   # its device check names their --device\n"
        f"  swarm stage-server --join {out.name} --device DEVICE   # the device doctor picked{nat}"
    )
    return 0
