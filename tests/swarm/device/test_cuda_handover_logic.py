"""The CUDA handover's logic (`swarm.device.cuda_handover`) on a CPU, through its device seam's
stand-in (`swarm.device.cuda_ipc.HostIpc`: two "processes" of one stand-in device): the handle
torch gives goes to torch's `rebuild_cuda_tensor` as it came, whatever its length (torch 2.11's
66 bytes, the 64 of older torch, 70); a malformed one (past its storage, negative, of another
device, oversized) is refused with a clear error before any device call; a process takes its
own offers from its own tensors; a released offer frees its memory (and cannot be taken any
more); a slot that does not open is answered on the wire; and a replica turns a handle it cannot
take into a named refusal. The real device calls: tests/swarm/device/test_cuda_handover.py."""

from __future__ import annotations

import gc
import secrets
import threading
from collections.abc import Callable

import pytest
import torch

from stage_server.peer.metrics import StageMetrics
from stage_server.replica.handing import Handing
from swarm.device.cuda_handover import MAX_HANDLE_BYTES, REF_COUNTERS, CudaHandover
from swarm.device.cuda_ipc import HostDevice, HostIpc, torch_handle
from swarm.errors import HandoverRefused, InvalidArgument
from swarm.proto import tensor_pb2

pytestmark = pytest.mark.timeout(60)

N, AT, BLOCK = 1000, 7, 4096  # the payload: N bytes at AT within a larger allocation


def block() -> torch.Tensor:
    return (torch.arange(BLOCK) % 251).to(torch.uint8)


def pair(handle: Callable[[], bytes] = torch_handle) -> tuple[CudaHandover, CudaHandover]:
    """A sender and a receiver: two processes of one stand-in device."""
    host = HostDevice(handle)
    return CudaHandover(torch.device("cpu"), HostIpc(host)), CudaHandover(
        torch.device("cpu"), HostIpc(host)
    )


def ipc(h: CudaHandover) -> HostIpc:
    assert isinstance(h.ipc, HostIpc)
    return h.ipc


FORMATS: dict[str, tuple[Callable[[], bytes], int]] = {  # a handle's maker, its length
    "torch 2.11 (version, c, cudaIpcMemHandle_t)": (torch_handle, 66),
    "64 bytes (older torch)": (lambda: secrets.token_bytes(64), 64),
    "70 bytes": (lambda: b"\x03e" + secrets.token_bytes(68), 70),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_torchs_handle_reaches_its_rebuild_as_it_came(fmt: str) -> None:
    make, length = FORMATS[fmt]
    sender, receiver = pair(make)
    memory = block()
    offer = sender.offer(memory[AT : AT + N])
    handle = offer.handle.cuda.storage
    assert len(handle) == length
    wire = tensor_pb2.Handover.FromString(offer.handle.SerializeToString())  # as it travels
    taken = receiver.take(wire, N)
    memory.zero_()  # what was taken is the receiver's own copy
    assert torch.equal(taken, block()[AT : AT + N])
    [args] = ipc(receiver).rebuilt  # torch's arguments, by name
    assert args["storage_handle"] == handle, "the handle, byte for byte"
    assert args["tensor_offset"] == AT and args["tensor_size"] == torch.Size([N])
    assert args["storage_size_bytes"] == BLOCK and args["dtype"] == torch.uint8
    # a slot of the receiver's, filled by the sender through the same path
    slot = receiver.slot(N)
    assert sender.fill(slot.handle, block()[:N].flip(0).contiguous())
    assert torch.equal(slot.read(), block()[:N].flip(0))
    assert ipc(sender).rebuilt[-1]["storage_handle"] == slot.handle.cuda.storage
    offer.release()
    slot.release()


def malformed(c: tensor_pb2.CudaIpc) -> list[tuple[str, tensor_pb2.Handover, int]]:
    """(what the error says, a handle, the bytes asked) for each way a handle is wrong."""

    def changed(**fields: object) -> tensor_pb2.Handover:
        h = tensor_pb2.Handover(cuda=c)
        for name, value in fields.items():
            setattr(h.cuda, name, value)
        return h

    return [
        (
            f"{N} bytes at {BLOCK - N + 1} of a {BLOCK}-byte storage",
            changed(offset=BLOCK - N + 1),
            N,
        ),
        (f"{BLOCK + 1} bytes at {AT}", changed(), BLOCK + 1),
        ("negative size or offset", changed(offset=-1), N),
        ("negative size or offset", changed(storage_offset_bytes=-8), N),
        ("negative size or offset", changed(), -1),
        ("of device 3, not 0", changed(device=3), N),
        ("without a storage handle", changed(storage=b""), N),
        (
            f"storage handle of {MAX_HANDLE_BYTES + 1} bytes",
            changed(storage=b"x" * (MAX_HANDLE_BYTES + 1)),
            N,
        ),
        ("event handle of", changed(event=b"x" * (MAX_HANDLE_BYTES + 1)), N),
        # torch counts a share at this slot of its counters' file, unchecked: a slot past the
        # file's end was a write past a mapping (a review's repro)
        (
            f"ref counter slot {REF_COUNTERS} of {REF_COUNTERS}",
            changed(ref_counter_offset=REF_COUNTERS),
            N,
        ),
        ("not a CUDA handover", tensor_pb2.Handover(shm="swarm-ho-1-2-" + "0" * 32), N),
    ]


def test_a_malformed_handle_is_refused_before_any_device_call() -> None:
    sender, receiver = pair()
    offer = sender.offer(block()[AT : AT + N])
    for says, handle, nbytes in malformed(offer.handle.cuda):
        with pytest.raises(InvalidArgument, match=says):
            receiver.take(handle, nbytes)
        if nbytes >= 0:  # a slot that does not open: the answer goes on the wire
            assert not receiver.fill(handle, torch.zeros(nbytes, dtype=torch.uint8))
    assert ipc(receiver).rebuilt == [], "no handle that fails its checks reaches torch"
    offer.release()


def test_a_process_takes_its_own_offer_from_its_own_tensor() -> None:
    # CUDA IPC opens no allocation in the process that made it: the stand-in refuses that too,
    # so only the own-offer lookup takes it. Two payloads in one allocation are two offers.
    h, _ = pair()
    memory = block()
    first, second = h.offer(memory[AT : AT + N]), h.offer(memory[AT + N : AT + 2 * N])
    assert first.handle.cuda.storage == second.handle.cuda.storage, "one allocation"
    assert torch.equal(h.take(first.handle, N), block()[AT : AT + N])
    assert torch.equal(h.take(second.handle, N), block()[AT + N : AT + 2 * N])
    with pytest.raises(InvalidArgument, match=f"{N} bytes, not {N - 1}"):
        h.take(first.handle, N - 1)
    slot = h.slot(N)
    assert h.fill(slot.handle, block()[:N])
    assert torch.equal(slot.read(), block()[:N])
    assert ipc(h).rebuilt == []
    first.release()  # withdrawn: the lookup misses, and the device will not open its own
    with pytest.raises(RuntimeError, match="invalid device context"):
        h.take(first.handle, N)
    second.release()
    slot.release()


def test_a_released_share_is_freed_once_no_receiver_is_counted_on() -> None:
    # As torch does: each share counts on one receiver, which gives its count back when its
    # mapping goes; an allocation its maker let go lives on ("limbo") while one is counted on.
    host = HostDevice()
    sender, receiver = (CudaHandover(torch.device("cpu"), HostIpc(host)) for _ in range(2))
    offer = sender.offer(sender.ipc.empty(N).fill_(9))
    taken = receiver.take(offer.handle, N)  # mapped, copied, the mapping gone: count given back
    offer.release()
    gc.collect()
    assert host.live() == 0, "taken and released: freed"
    assert torch.equal(taken, torch.full((N,), 9, dtype=torch.uint8)), "the copy is the taker's"
    with pytest.raises(RuntimeError, match="invalid resource handle"):
        receiver.take(offer.handle, N)
    slot = receiver.slot(N)  # a slot nobody fills (the answer came on the wire)
    slot.release()
    gc.collect()
    assert host.live() == 1, "in limbo: it still counts on a receiver"
    unused = receiver.slot(N)
    unused.unused()  # its owner knows no receiver mapped it
    unused.unused()  # once only
    unused.release()
    gc.collect()
    assert host.live() == 1, "given back: freed (the first slot stays in limbo)"
    assert not sender.fill(unused.handle, taken), "a released slot: the answer goes on the wire"


def test_a_process_gives_back_the_count_of_what_it_took_from_itself() -> None:
    host = HostDevice()
    h = CudaHandover(torch.device("cpu"), HostIpc(host))
    offer, slot = h.offer(h.ipc.empty(N).fill_(3)), h.slot(N)
    h.take(offer.handle, N)
    assert h.fill(slot.handle, torch.ones(N, dtype=torch.uint8))
    offer.release()
    slot.release()
    gc.collect()
    assert host.live() == 0


def test_a_slot_of_another_size_or_device_is_answered_on_the_wire() -> None:
    sender, receiver = pair()
    slot = receiver.slot(N)
    assert not sender.fill(slot.handle, block()[: N + 1])
    other = tensor_pb2.Handover()
    other.CopyFrom(slot.handle)
    other.cuda.device = 1
    assert not sender.fill(other, block()[:N])
    slot.release()


def test_a_replica_refuses_a_handle_it_cannot_take_by_name() -> None:
    host = HostDevice()
    handing = Handing(
        StageMetrics("p"),
        make=lambda d: CudaHandover(d, HostIpc(host)),
        site_of=lambda _d: "host/cuda-0",
    )
    handing.serve(torch.device("cpu"))
    sender = CudaHandover(torch.device("cpu"), HostIpc(host))
    offer = sender.offer(block()[AT : AT + N])
    meta = tensor_pb2.Tensor(name="inputs", nbytes=N, handover=offer.handle)
    assert torch.equal(handing.take(0, meta), block()[AT : AT + N])
    meta.handover.cuda.offset = BLOCK
    with pytest.raises(HandoverRefused, match="handover refused: tensor 'inputs': CUDA handover"):
        handing.take(0, meta)
    offer.release()
    meta.handover.cuda.offset = AT
    with pytest.raises(HandoverRefused, match="invalid resource handle"):
        handing.take(0, meta)


def test_the_allocations_alive_are_read_while_another_thread_shares() -> None:
    """`HostDevice.alive()` is read by a test's step hook on the event loop's thread while the
    servers' worker threads share allocations (tests/test_handover_flat.py). Before, it iterated
    the allocations without the lock its writers hold: "dictionary changed size during
    iteration", one CI run in a few."""
    host = HostDevice()
    kept = [torch.UntypedStorage(8) for _ in range(4_000)]
    for storage in kept[:2_000]:
        host.share(storage)
    errors: list[BaseException] = []

    def sharing() -> None:
        try:
            for storage in kept[2_000:]:
                host.share(storage)
        except BaseException as e:  # said below, on the test's thread
            errors.append(e)

    thread = threading.Thread(target=sharing)
    thread.start()
    seen = 0
    while thread.is_alive():
        seen = max(seen, len(host.alive()))
    thread.join()
    assert not errors
    assert len(host.alive()) == 4_000 and seen <= 4_000
