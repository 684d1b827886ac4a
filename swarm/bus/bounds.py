"""What a peer's announcement may hold, checked where it enters every process that reads it
(the bus's dispatch, `swarm.bus.subscriptions`): each of its texts at most `MAX_TEXT_CHARS`
(an address is a 253-character name and a port; an id, a device, a job's id far shorter), at
most `MAX_STAGES` measured stages and a memory of at most `MAX_MEMORY_BYTES`. Past them it is
no honest peer's: one of a megabyte went into the scheduler's retained reachability report
twice, past the broker's packet cap, which closed the scheduler's connection at each
reconnect; and made-up peers each kept megabytes in the scheduler."""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from swarm.job.schema import MAX_STAGES
from swarm.proto import control_pb2 as cpb

__all__ = ["MAX_TEXT_CHARS", "check_bounds"]

MAX_TEXT_CHARS = 512  #: the longest text field of a peer's announcement
# A device's memory at most (1 PiB): one announced past it made every job fit at submit (the
# largest memory a peer has is what a job is refused against, `scheduler.admission`)
MAX_MEMORY_BYTES = 1 << 50


def check_bounds(message: Message) -> None:
    """DecodeError (the bus's word for a malformed message) where a peer's announcement is past
    its bounds; other messages pass (the scheduler's own, or bounded at their source)."""
    if not isinstance(message, cpb.PeerAnnouncement):
        return
    for field, value in message.ListFields():
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            raise DecodeError(f"{field.name} of {len(value)} characters (at most {MAX_TEXT_CHARS})")
    if message.memory_bytes > MAX_MEMORY_BYTES:  # the too-large-job check's yardstick
        raise DecodeError(f"memory_bytes {message.memory_bytes} (at most {MAX_MEMORY_BYTES})")
    if len(message.samples_per_second) > MAX_STAGES:
        raise DecodeError(
            f"{len(message.samples_per_second)} stages measured (at most {MAX_STAGES})"
        )
