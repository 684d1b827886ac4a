"""This swarm's MQTT naming: broker URLs, topic names and the payload type of each topic.

Peers, the scheduler and trainers share membership, assignments and load through topics under a
prefix (default `swarm/v1/`); payloads are the protobuf messages of `control.proto`, typed by the
topic's kind. Pure functions only: the connection itself is `swarm.bus.connection.Bus`.

A peer writes two topics, whatever job it serves: `peers/{peer}` and `peers/{peer}/load` (the job
is inside the load report). Why not one load topic per job: a broker bounds what it retains per
topic, and Mosquitto (whose ACL cannot see the retain flag, and which bounds no one user's retained
bytes) would keep a message on every job id a peer made up, until its heap cap refused everyone.
With a fixed set, what a peer can leave retained is two topics x the packet cap.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from google.protobuf.message import Message

from swarm.errors import ConfigError, SwarmError
from swarm.proto import control_pb2

__all__ = [
    "ANY",
    "DEFAULT_PREFIX",
    "MESSAGE_TYPES",
    "SCHEDULER_USER",
    "TOOL_USER",
    "BrokerAddress",
    "BrokerUrlError",
    "BusError",
    "TopicError",
    "TopicInfo",
    "TopicKind",
    "Topics",
    "check_pattern",
    "check_topic",
    "parse_broker_url",
    "reachability",
    "topic_matches",
]

DEFAULT_PREFIX = "swarm/v1/"
SCHEDULER_USER = "scheduler"
"""The scheduler's MQTT username: the one user the brokers' ACLs let publish every topic (jobs,
assignments, steps); any other user is a peer, and publishes only `peers/{user}` and
`peers/{user}/load` (`Topics.may_publish`)."""
TOOL_USER = "swarm"
"""Who logs in with the token but no id of its own: trainers outside the scheduler and `swarm`
tools (`swarm.bus.link.Dialer`); it reads the swarm and publishes nothing of anyone's."""
ANY = "+"
"""Pass as an id to a `Topics` builder to get a single-level wildcard pattern."""

_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
_URL_FORM = "mqtt://[user:password@]host[:port] or mqtts://..."


class BusError(SwarmError):
    """Base of the control-plane bus errors."""


class BrokerUrlError(BusError, ConfigError):
    """A broker URL that cannot be used; the message shows the accepted form."""


class TopicError(BusError, ValueError):
    """An id that cannot be a topic level, or a topic outside this swarm's scheme."""


# ------------------------------------------------------------------------------------ addresses


@dataclasses.dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to log in; `password` is kept out of `repr`."""

    host: str
    port: int
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls: bool = False

    @property
    def url(self) -> str:
        """The address as a URL without credentials, for log lines."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"


def _redact(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse `mqtt://[user:password@]host[:port]` (or `mqtts://`, TLS); default ports 1883/8883."""
    shown = _redact(url)
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise BrokerUrlError(f"bad broker URL {shown!r} ({exc}); expected {_URL_FORM}") from None
    if parts.scheme not in _DEFAULT_PORTS:
        raise BrokerUrlError(f"bad broker URL {shown!r}: scheme is not mqtt/mqtts ({_URL_FORM})")
    if not parts.hostname:
        raise BrokerUrlError(f"bad broker URL {shown!r}: no host ({_URL_FORM})")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BrokerUrlError(f"bad broker URL {shown!r}: no path or query allowed ({_URL_FORM})")
    if port == 0:
        raise BrokerUrlError(f"bad broker URL {shown!r}: port 0 ({_URL_FORM})")
    return BrokerAddress(
        host=parts.hostname,
        port=port or _DEFAULT_PORTS[parts.scheme],
        username=None if parts.username is None else unquote(parts.username),
        password=None if parts.password is None else unquote(parts.password),
        tls=parts.scheme == "mqtts",
    )


# --------------------------------------------------------------------------------------- topics


class TopicKind(enum.StrEnum):
    """What a topic carries; selects the payload type in `MESSAGE_TYPES`."""

    PEER = "peer"  # peers/{peer}
    JOB = "job"  # jobs/{job}
    ASSIGN = "assign"  # jobs/{job}/assign/{peer}
    LOAD = "load"  # peers/{peer}/load, the job in the payload
    STEPS = "steps"  # jobs/{job}/steps
    REACHABILITY = "reachability"  # peers/{peer}/reachability, the scheduler's dial-back


class TopicInfo(NamedTuple):
    """A parsed topic; `job`/`peer` are None where the topic has no such level."""

    kind: TopicKind
    job: str | None
    peer: str | None


MESSAGE_TYPES: dict[TopicKind, type[Message]] = {
    TopicKind.PEER: control_pb2.PeerAnnouncement,
    TopicKind.JOB: control_pb2.JobAnnouncement,
    TopicKind.ASSIGN: control_pb2.Assignment,
    TopicKind.LOAD: control_pb2.LoadReport,
    TopicKind.STEPS: control_pb2.StepCommitted,
    TopicKind.REACHABILITY: control_pb2.ReachabilityReport,
}
"""The payload type of each topic kind."""

_BAD_LEVEL = re.compile(r"[/+#\x00]")


def _level(value: str, *, wildcard: bool) -> str:
    if wildcard and value == ANY:
        return value
    if not value or _BAD_LEVEL.search(value):
        raise TopicError(f"{value!r} cannot be a topic level: use a non-empty id without / + #")
    return value


def topic_matches(topic: str, pattern: str) -> bool:
    """Whether `topic` matches the MQTT filter `pattern` (`+` one level, trailing `#` the rest)."""
    if topic.startswith("$") and pattern[:1] in ("+", "#"):
        return False
    levels = topic.split("/")
    filters = pattern.split("/")
    for i, f in enumerate(filters):
        if f == "#":
            return True  # also matches the parent level itself, as MQTT specifies
        if i >= len(levels) or (f != "+" and f != levels[i]):
            return False
    return len(levels) == len(filters)


class Topics:
    """Builds and parses this swarm's topic names under `prefix`; pass `ANY` for a wildcard."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if _BAD_LEVEL.search(prefix.replace("/", "")) or "//" in prefix or prefix.startswith("/"):
            raise TopicError(f"bad topic prefix {prefix!r}: use levels like 'swarm/v1/'")
        self.prefix = prefix

    def peer(self, peer: str) -> str:
        return f"{self.prefix}peers/{_level(peer, wildcard=True)}"

    def job(self, job: str) -> str:
        return f"{self.prefix}jobs/{_level(job, wildcard=True)}"

    def assign(self, job: str, peer: str) -> str:
        return f"{self.job(job)}/assign/{_level(peer, wildcard=True)}"

    def load(self, peer: str) -> str:
        """`peer`'s load reports, of whichever job it serves (`LoadReport.job` says which)."""
        return f"{self.peer(peer)}/load"

    def steps(self, job: str) -> str:
        return f"{self.job(job)}/steps"

    def reachability(self, peer: str) -> str:
        """What the scheduler's dial-back of `peer` found (`ReachabilityReport`, retained): only
        the scheduler writes it, and only the scheduler and `peer` itself read it."""
        return f"{self.peer(peer)}/reachability"

    def may_publish(self, user: str | None, topic: str) -> bool:
        """The brokers' ACL: whether MQTT user `user` may publish on `topic`. The scheduler may
        publish anything; a peer (its username is its id) only its two topics, its announcement
        and its load reports (`peers/{peer}`, `peers/{peer}/load`); a client without a username
        nothing under the prefix (an open broker lets it in only when it has no token at all: see
        `swarm.bus.broker`)."""
        if user == SCHEDULER_USER:
            return True
        if not user or user == TOOL_USER or not topic.startswith(self.prefix):
            return False  # (the tools' user is no peer: it reads, only)
        try:
            info = self.parse(topic)
        except TopicError:
            return False
        return info.kind in (TopicKind.PEER, TopicKind.LOAD) and info.peer == user

    def may_read(self, user: str | None, topic: str) -> bool:
        """The brokers' read ACL: everyone who may connect reads the swarm, except a peer's
        reachability report (`reachability`), which only the scheduler and that peer read: it
        names the peer's network trouble (its dial error), no one else's business."""
        if user == SCHEDULER_USER:
            return True
        try:
            info = self.parse(topic)
        except TopicError:
            return True  # not one of ours (or not under the prefix): nothing the swarm guards
        if user == TOOL_USER and info.peer == user:
            return False  # no peer: the ACLs deny its name's topics (`acl_text`)
        return info.kind != TopicKind.REACHABILITY or info.peer == user

    def everything(self) -> str:
        """The pattern matching every topic of this swarm."""
        return f"{self.prefix}#"

    def parse(self, topic: str) -> TopicInfo:
        """(kind, job, peer) of a concrete topic; `TopicError` when it is not one of ours."""
        if not topic.startswith(self.prefix):
            raise TopicError(f"topic {topic!r} is outside prefix {self.prefix!r}")
        levels = topic[len(self.prefix) :].split("/")
        try:
            for level in levels[1:]:
                _level(level, wildcard=False)
        except TopicError:
            raise TopicError(f"topic {topic!r} has an empty or wildcard level") from None
        match levels:
            case ["peers", peer]:
                return TopicInfo(TopicKind.PEER, None, peer)
            case ["peers", peer, "load"]:
                return TopicInfo(TopicKind.LOAD, None, peer)
            case ["peers", peer, "reachability"]:
                return TopicInfo(TopicKind.REACHABILITY, None, peer)
            case ["jobs", job]:
                return TopicInfo(TopicKind.JOB, job, None)
            case ["jobs", job, "steps"]:
                return TopicInfo(TopicKind.STEPS, job, None)
            case ["jobs", job, "assign", peer]:
                return TopicInfo(TopicKind.ASSIGN, job, peer)
        raise TopicError(f"topic {topic!r} is not a swarm topic")


def reachability(peer: str, prefix: str = DEFAULT_PREFIX) -> str:
    """`Topics(prefix).reachability(peer)`: where the scheduler retains `peer`'s report."""
    return Topics(prefix).reachability(peer)


def check_topic(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic or "\x00" in topic:
        raise TopicError(f"cannot publish to {topic!r}: a topic is non-empty, without + # NUL")


def check_pattern(pattern: str) -> None:
    levels = pattern.split("/")
    if (
        not pattern
        or "\x00" in pattern
        or any(
            ("+" in lv and lv != "+") or ("#" in lv and (lv != "#" or i != len(levels) - 1))
            for i, lv in enumerate(levels)
        )
    ):
        raise TopicError(f"bad subscription pattern {pattern!r}: + is a whole level, # the last")
