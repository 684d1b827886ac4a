"""What a peer's announcement may hold, checked where it enters every process that reads it
(the bus's dispatch, `swarm.bus.subscriptions`): each of its texts at most `MAX_TEXT_CHARS`
(an address is a 253-character name and a port; an id, a device, a job's id far shorter), at
most `MAX_STAGES` measured stages and a memory of at most `MAX_MEMORY_BYTES`. Past them it is
no honest peer's: one of a megabyte went into the scheduler's retained reachability report
twice, past the broker's packet cap, which closed the scheduler's connection at each
reconnect; and made-up peers each kept megabytes in the scheduler.

A message a peer publishes (its announcement, its load report) is bounded in bytes before it is
decoded (`MAX_PEER_MESSAGE_BYTES`, `check_size`): a map of 139,000 sparse stages, 2 MB under the
packet cap, took a quarter second of every reader's event loop to decode before its bounds
refused it. Fields a reader does not know are not kept (the bounds read the known ones), and
the peer a topic names is at most a peer id's length (`swarm.net.peer_ids`), with no control
character: it replaces the payload's, which was bounded while the topic's was not, and goes into
log lines as it is."""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from swarm.bus.topics import TopicInfo, TopicKind
from swarm.job.schema import MAX_STAGES
from swarm.net.peer_ids import MAX_PEER_ID_CHARS
from swarm.proto import control_pb2 as cpb

__all__ = [
    "MAX_MEMORY_BYTES",
    "MAX_PEER_MESSAGE_BYTES",
    "MAX_TEXT_CHARS",
    "check_bounds",
    "check_size",
]

MAX_TEXT_CHARS = 512  #: the longest text field of a peer's announcement
# A device's memory at most (1 PiB): one announced past it made every job fit at submit (the
# largest memory a peer has is what a job is refused against, `scheduler.admission`)
MAX_MEMORY_BYTES = 1 << 50
# A peer's message at most, encoded: its largest honest announcement (every text at its bound,
# every stage measured) is under 16 KiB (tests/swarm/bus/test_bounded_messages.py).
MAX_PEER_MESSAGE_BYTES = 32 << 10
# What peers publish (`Topics.may_publish`): the rest is the scheduler's own.
_PEERS_KINDS = frozenset({TopicKind.PEER, TopicKind.LOAD})


def check_size(info: TopicInfo, payload: bytes | bytearray) -> None:
    """DecodeError, before anything is decoded, where a message a peer publishes is past
    `MAX_PEER_MESSAGE_BYTES` or its topic names a peer past a peer id's length."""
    if info.peer is not None and len(info.peer) > MAX_PEER_ID_CHARS:
        raise DecodeError(f"a peer id of {len(info.peer)} characters (at most {MAX_PEER_ID_CHARS})")
    if info.peer is not None and not info.peer.isprintable():
        # no peer id holds one; said in a log line, a newline would forge the next
        raise DecodeError("a peer id with a control character")
    if info.kind in _PEERS_KINDS and len(payload) > MAX_PEER_MESSAGE_BYTES:
        raise DecodeError(f"{len(payload)} bytes from a peer (at most {MAX_PEER_MESSAGE_BYTES})")


def check_bounds(message: Message) -> None:
    """DecodeError (the bus's word for a malformed message) where a peer's announcement or load
    report is past its bounds; other messages pass (the scheduler's own). What no field of its
    type holds is dropped first: nobody reads it, and it would be kept."""
    message.DiscardUnknownFields()
    if not isinstance(message, cpb.PeerAnnouncement | cpb.LoadReport):
        return
    for field, value in message.ListFields():
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            raise DecodeError(f"{field.name} of {len(value)} characters (at most {MAX_TEXT_CHARS})")
    if not isinstance(message, cpb.PeerAnnouncement):
        return
    if message.memory_bytes > MAX_MEMORY_BYTES:  # the too-large-job check's yardstick
        raise DecodeError(f"memory_bytes {message.memory_bytes} (at most {MAX_MEMORY_BYTES})")
    if len(message.samples_per_second) > MAX_STAGES:
        raise DecodeError(
            f"{len(message.samples_per_second)} stages measured (at most {MAX_STAGES})"
        )
