"""A push-plane replica's records (`stage_server.replica.push_records`): each run of a microbatch
its own, committed to as the digests of what came in and went out (of the tensor decoded, so the
receiver's digest of what it decoded is the same), the oldest dropped past the limit, and the
tensors handed back as they were committed to."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stage_server.replica.push_records import NO_RECORD, Arrived, PushRecords, sent_digest
from swarm.errors import ActivationsNotCached
from swarm.proto import stage_pb2 as pb
from swarm.wire import codec
from swarm.wire.digest import digest


def test_a_record_commits_to_what_came_in_and_went_out() -> None:
    records = PushRecords("s1r0", lambda: 4)
    record = records.begin(1, 3, 0, run=7)
    x = torch.randn(2, 3, dtype=torch.float64)
    record.received("inputs", x)
    out = codec.encode(x * 2, "inputs", codec.codec_from_name("bf16"))
    record.sent("outputs", lambda: out)
    answer = records.answer(
        pb.StageRecordRequest(microbatch=pb.MicrobatchId(step=3, index=0), run=7, tensors_too=True)
    )
    c = answer.commitment
    assert (c.peer, c.stage, c.run) == ("s1r0", 1, 7)
    assert c.inputs == digest(x) and c.grad_inputs == b""
    # the receiver decodes the lossy message it was sent: its digest is the committed one
    assert c.outputs == digest(codec.decode(out)) != digest(x * 2)
    sent = {t.name: codec.decode(t) for t in answer.tensors}
    assert digest(sent["inputs"]) == c.inputs and digest(sent["outputs"]) == c.outputs
    bare = records.answer(pb.StageRecordRequest(microbatch=c.microbatch, run=7))
    assert bare.commitment == c and not bare.tensors


def test_each_run_has_its_own_record_and_the_oldest_go_first() -> None:
    records = PushRecords("s1r0", lambda: 2)
    records.begin(1, 0, 0, run=1).received("inputs", torch.zeros(1))
    records.begin(1, 0, 0, run=2).received("inputs", torch.ones(1))  # a replay: another run
    assert records.get(0, 0, 1).commitment.inputs == digest(torch.zeros(1))
    assert records.get(0, 0, 2).commitment.inputs == digest(torch.ones(1))
    records.begin(1, 0, 1, run=3)
    with pytest.raises(ActivationsNotCached):
        records.get(0, 0, 1)  # dropped: the limit is 2


@pytest.mark.parametrize("form", ["inline", "chunked", "handed"])
def test_a_tensor_is_kept_as_it_came_and_answered_as_it_crossed(form: str) -> None:
    """What came in lossy is kept in its payload, whichever way it came (in the message, in a
    chunked stream's buffer, handed over as a uint8 tensor), never widened: the answer is the
    wire's bytes, which decode bitwise to the tensor committed to."""
    sent = codec.encode(torch.randn(4, 64), "inputs", codec.codec_from_name("hadamard3"))
    payload: bytes | memoryview | torch.Tensor = sent.data
    if form == "chunked":
        payload = memoryview(bytearray(sent.data))
    elif form == "handed":
        payload = torch.frombuffer(bytearray(sent.data), dtype=torch.uint8)
    decoded = codec.decode(sent, payload)
    record = PushRecords("s1r0", lambda: 4).begin(1, 0, 0, run=1)
    record.received("inputs", decoded, Arrived.of(sent, payload))
    (msg,) = record.messages()
    assert msg.data == sent.data and msg.nbytes == len(sent.data) < decoded.numel()
    assert (msg.codec, msg.block_size, msg.shape) == (sent.codec, sent.block_size, sent.shape)
    assert digest(codec.decode(msg)) == record.commitment.inputs == digest(decoded)


def test_a_run_nobody_audits_keeps_nothing_and_makes_nothing() -> None:
    """The null record (`NO_RECORD`): the push plane tells it the same, and it makes no message
    (no copy from the device), computes no digest and keeps nothing."""

    def made() -> None:
        raise AssertionError("a run nobody audits made what it sent")

    assert not NO_RECORD.kept
    NO_RECORD.received("inputs", torch.zeros(1))
    NO_RECORD.sent("outputs", made)


def test_digests_taken_on_the_digester_are_the_same_commitment() -> None:
    """Off the event loop (issue 69): a record's digests taken on a thread of their own commit
    to what the same record would at once, and `settled` returns once every one is in."""
    x = torch.randn(8, 16, 32)
    out = codec.encode(x * 3, "inputs")
    at_once = PushRecords("s1r0", lambda: 4).begin(1, 0, 0, run=5)
    with ThreadPoolExecutor(1) as digester:
        records = PushRecords("s1r0", lambda: 4, digester)
        later = records.begin(1, 0, 0, run=5)
        for record in (at_once, later):
            record.received("inputs", x)
            record.sent("outputs", lambda: out)
            record.sent("grad_inputs", lambda: torch.ones(2))
        asyncio.run(later.settled())
        assert all(taken.done() for taken in later._pending.values())  # the answer waits on none
        answer = records.answer(
            pb.StageRecordRequest(microbatch=pb.MicrobatchId(step=0, index=0), run=5)
        )
    assert answer.commitment == at_once.commitment
    assert answer.commitment.outputs == digest(codec.decode(out)) == sent_digest(out)


@pytest.mark.parametrize("name", ["none", "hadamard3"])
def test_bytes_handed_over_are_kept_as_they_went_and_committed_to_as_the_message(
    name: str,
) -> None:
    """Issue 69: outputs handed over (or a gradient written into a slot) are kept as their
    payload, no message made for the record: committed to as the message of the same bytes
    would be (the receiver's digest, or an older peer's, agrees), and answered as those bytes."""
    x = torch.randn(4, 64)
    header, payload = codec.encode_payload(x, "inputs", codec.codec_from_name(name))
    wire = codec.encode(x, "inputs", codec.codec_from_name(name))
    as_message = PushRecords("s1r0", lambda: 4).begin(1, 0, 0, run=3)
    as_message.sent("outputs", lambda: wire)
    handed = PushRecords("s1r0", lambda: 4).begin(1, 0, 0, run=3)
    handed.sent("outputs", lambda: Arrived.of(header, payload))
    assert handed.commitment == as_message.commitment
    assert handed.commitment.outputs == digest(codec.decode(wire))
    (msg,) = handed.messages()
    assert msg.name == "outputs" and msg.data == wire.data and msg.nbytes == wire.nbytes
    assert (msg.codec, msg.block_size, msg.shape) == (wire.codec, wire.block_size, wire.shape)


async def test_a_record_asked_while_its_digests_are_taken_waits_off_the_event_loop() -> None:
    # A Record for a run whose push was still in flight waited on the digester with the event
    # loop's thread (992 ms of it measured, every other call of the server waiting), and
    # walked the pending digests the worker's thread was adding to.
    held = threading.Event()
    with ThreadPoolExecutor(1) as digester:
        digester.submit(held.wait, 10)  # the digester busy with another run's digests
        records = PushRecords("s1r0", lambda: 4, digester)
        record = records.begin(1, 0, 0, run=5)
        record.received("inputs", torch.ones(4))
        request = pb.StageRecordRequest(microbatch=pb.MicrobatchId(step=0, index=0), run=5)
        asked = asyncio.ensure_future(records.answered(request))
        ticks = 0
        for _ in range(20):  # 0.2 s of the loop, the digest not taken meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not asked.done() and ticks == 20
        held.set()
        answer = await asyncio.wait_for(asked, 10)
    assert answer.commitment.inputs == digest(torch.ones(4))


async def test_a_push_cancelled_while_its_digests_are_taken_still_waits_for_them() -> None:
    """A caller hung up while its push waited for its record's digests: the wait was cancelled
    with them, the queued digests with it and the running one left reading tensors the push let
    go, and the kept record then answered a cancellation (a review found it). The push waits for
    every digest, then is cancelled."""
    release = threading.Event()

    def slow_digest(t: torch.Tensor) -> bytes:
        release.wait(5.0)
        return digest(t)

    with ThreadPoolExecutor(1) as digester:
        record = PushRecords("s1r0", lambda: 4, digester).begin(1, 0, 0, run=5)
        record._commit("inputs", lambda: slow_digest(torch.ones(2)))  # the running one
        record.received("grad_outputs", torch.zeros(2))  # queued behind it
        waiting = asyncio.create_task(record.settled())
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        assert not waiting.done(), "the push went on while its digests were taken"
        release.set()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled()
        assert all(f.done() and not f.cancelled() for f in record._pending.values())
        assert record.commitment.grad_outputs == digest(torch.zeros(2))
