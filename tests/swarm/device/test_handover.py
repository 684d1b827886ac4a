"""The shared-memory handover (`swarm.device.shm_handover`) for real, in a directory of its own:
bytes offered are taken as a copy the receiver owns, a slot is filled and read, names that are
not handover segments are refused, a SIGKILLed creator's segments are swept on the next start;
the codec decodes a handed-over payload as it decodes the wire's bytes; a message that names a
handover is refused where none is taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from swarm.device.shm_handover import PREFIX, SharedMemoryHandover, sweep
from swarm.device.site import site
from swarm.errors import InvalidArgument
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.wire import codec
from swarm.wire.chunking import receive
from tests.support.disks import tiny_disk

pytestmark = pytest.mark.timeout(60)


def payload(n: int = 1000) -> torch.Tensor:
    return (torch.arange(n) % 251).to(torch.uint8)


def test_bytes_offered_are_taken_as_the_receivers_own_copy(tmp_path: Path) -> None:
    sender, receiver = SharedMemoryHandover(tmp_path), SharedMemoryHandover(tmp_path)
    offer = sender.offer(payload())
    got = receiver.take(offer.handle, offer.nbytes)
    offer.release()  # the sender lets go: what the receiver took is its own
    assert torch.equal(got, payload())
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidArgument, match="No such file"):
        receiver.take(offer.handle, offer.nbytes)  # released: nothing to read any more


def test_a_slot_is_filled_by_the_other_side_and_read_by_its_owner(tmp_path: Path) -> None:
    caller, replica = SharedMemoryHandover(tmp_path), SharedMemoryHandover(tmp_path)
    slot = caller.slot(1000)
    assert replica.fill(slot.handle, payload())
    assert torch.equal(slot.read(), payload())
    assert not replica.fill(slot.handle, payload(999)), "another size: the wire then"
    slot.release()
    assert not replica.fill(slot.handle, payload()), "released: the wire then"
    assert os.listdir(tmp_path) == []


def test_a_size_other_than_the_header_says_is_refused(tmp_path: Path) -> None:
    h = SharedMemoryHandover(tmp_path)
    offer = h.offer(payload())
    with pytest.raises(InvalidArgument, match="1000 bytes, not 4096"):
        h.take(offer.handle, 4096)
    offer.release()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "swarm-ho-1-2-zz", f"{PREFIX}1-2-{'0' * 31}/x", "", "shadow"]
)
def test_only_handover_segments_are_opened(tmp_path: Path, name: str) -> None:
    h = SharedMemoryHandover(tmp_path)
    with pytest.raises(InvalidArgument, match="not a handover segment"):
        h.take(tensor_pb2.Handover(shm=name), 10)
    assert not h.fill(tensor_pb2.Handover(shm=name), payload(10))


@pytest.mark.parametrize("way", ["take", "fill"])
def test_a_segment_that_is_no_file_is_refused_at_once(tmp_path: Path, way: str) -> None:
    # A review's repro: any local process may make a FIFO of a segment's name in /dev/shm. Its
    # open blocked until a writer (a reader) came: a take, on the event loop, stalled every
    # call of the process; a fill its worker. Refused now, unopened, as no segment.
    name = f"{PREFIX}1-2-{'0' * 32}"
    os.mkfifo(tmp_path / name)
    h, outcome = SharedMemoryHandover(tmp_path), list[object]()

    def attempt() -> None:
        handle = tensor_pb2.Handover(shm=name)
        try:
            outcome.append(h.take(handle, 10) if way == "take" else h.fill(handle, payload(10)))
        except InvalidArgument as e:
            outcome.append(e)

    attempting = threading.Thread(target=attempt, daemon=True)
    attempting.start()
    attempting.join(5)
    if attempting.is_alive():  # blocked in its open: let it go (the other end opens)
        os.close(os.open(tmp_path / name, os.O_RDWR | os.O_NONBLOCK))
        attempting.join(5)
        pytest.fail(f"the {way} blocked on a FIFO")
    if way == "take":
        assert isinstance(outcome[0], InvalidArgument), outcome
        assert "not a regular file" in str(outcome[0]), outcome
    else:
        assert outcome == [False]


def test_an_offer_the_disk_cannot_hold_leaves_no_segment(tmp_path: Path) -> None:
    """/dev/shm full (a container's 64 MiB): the offer's write failed part way and its segment
    stayed, holding what it had written of every free byte until its process exited, and every
    co-located server's handover, and anything else of the host's /dev/shm, was starved."""
    with tiny_disk(tmp_path / "shm", "64k") as disk:
        handover = SharedMemoryHandover(disk)
        with pytest.raises(OSError):
            handover.offer(torch.ones(1 << 20, dtype=torch.uint8))
        assert [p.name for p in disk.iterdir() if p.name.startswith(PREFIX)] == []
        assert handover.offer(torch.ones(1024, dtype=torch.uint8)).read().sum() == 1024


def test_a_sigkilled_creators_segments_are_swept_on_the_next_start(tmp_path: Path) -> None:
    # A process offers a segment and is SIGKILLed before it can release it: the segment stays
    # (tmpfs is freed only on unlink), until a new handover on the host sweeps it.
    mine = SharedMemoryHandover(tmp_path).offer(payload())
    child = (
        "import os, signal, sys, torch\n"
        "from pathlib import Path\n"
        "from swarm.device.shm_handover import SharedMemoryHandover\n"
        "o = SharedMemoryHandover(Path(sys.argv[1])).offer(torch.zeros(8, dtype=torch.uint8))\n"
        "print(o.handle.shm, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = done.stdout.strip()
    assert left in os.listdir(tmp_path), "a SIGKILLed creator leaves its segment"
    assert sweep(tmp_path) == [left]
    assert os.listdir(tmp_path) == [mine.handle.shm], "a live creator's stays"
    mine.release()


@pytest.mark.parametrize("name", ["none", "bf16", "fp16", "int8_blockwise", "hadamard3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_handed_over_payload_decodes_as_the_wire_bytes_do(name: str, dtype: torch.dtype) -> None:
    t = torch.randn(3, 700, generator=torch.Generator().manual_seed(1)).to(dtype)
    msg = codec.encode(t, "inputs", codec.codec_from_name(name))
    header, wire = codec.encode_payload(t, "inputs", codec.codec_from_name(name))
    assert header.nbytes == msg.nbytes == codec.expected_payload(header)
    assert torch.equal(codec.decode(header, wire.clone()), codec.decode(msg))


def test_a_payload_of_another_length_is_refused() -> None:
    header, wire = codec.encode_payload(torch.zeros(4, dtype=torch.float64), "inputs")
    with pytest.raises(InvalidArgument, match="expected 32 payload bytes, got 31"):
        codec.decode(header, wire[:31].clone())


async def test_a_handover_is_refused_where_none_is_taken() -> None:
    # A hostile caller that names a segment in a call other than a Push (or to a replica with
    # no site) gets INVALID_ARGUMENT before anything is opened.
    named = tensor_pb2.Tensor(
        name="inputs", dtype="float64", shape=[4], nbytes=32, handover=tensor_pb2.Handover(shm="x")
    )

    async def one() -> object:
        yield pb.StagePushRequest(tensors=[named])

    with pytest.raises(InvalidArgument, match="a handover is not taken here"):
        await receive(one(), max_bytes=1 << 20)


def test_the_site_is_the_kernels_and_off_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    here = site()
    assert here and here == site("cpu") and "uid-" in here
    monkeypatch.setenv("SWARM_HANDOVER", "off")
    assert site() == ""
