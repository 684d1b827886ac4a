"""A replica's handover choice (`stage_server.replica.handing`) with a fake `Handover` behind
the Protocol seam: a push goes on the wire until the replica pushed to answered the same site,
then its inputs are handed over with a slot for the gradient, each try's slot released when it
ends; the outputs are offered once for every try and released once; a gradient is written into
the caller's slot when it opens, and sent as bytes when it does not. The real handovers
are tested in tests/swarm/device/test_handover.py and, across processes,
tests/system/test_handover.py."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from stage_server.peer.metrics import StageMetrics
from stage_server.replica.handing import KEPT_PEERS, Handing, Outgoing
from stage_server.replica.messages import Limits, Messages
from stage_server.replica.next_hop import NextHop, Onward, Pushed
from swarm.device.handover import Offer
from swarm.device.host_copies import TorchHostCopies
from swarm.errors import Busy, HandoverRefused, InvalidArgument, PeerUnavailable
from swarm.proto import stage_pb2 as pb
from swarm.proto import tensor_pb2
from swarm.rpc.push_call import PushCall
from swarm.wire import codec
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job
from tests.support.stages import FakeCalls

pytestmark = pytest.mark.timeout(30)

SITE = "boot/ipc/shm/uid"


class FakeHandover:
    """A `Handover` in a dict: what is offered or slotted lives there until released."""

    kind = "fake"

    def __init__(self, fills: bool = True) -> None:
        self.store: dict[str, torch.Tensor] = {}
        self.unused: list[str] = []  # offers and slots whose owner said nobody mapped them
        self.fills, self._names = fills, itertools.count()

    def offer(self, payload: torch.Tensor) -> Offer:
        offer = self.slot(payload.numel())
        self.store[offer.handle.shm].copy_(payload)
        return offer

    def take(self, handle: tensor_pb2.Handover, nbytes: int) -> torch.Tensor:
        if handle.shm not in self.store:
            raise InvalidArgument("gone")
        return self.store[handle.shm].clone()

    def slot(self, nbytes: int) -> Offer:
        name = f"seg{next(self._names)}"
        self.store[name] = torch.zeros(nbytes, dtype=torch.uint8)
        return Offer(
            tensor_pb2.Handover(shm=name),
            nbytes,
            read=lambda: self.store[name].clone(),
            release=lambda: self.store.pop(name, None),  # type: ignore[arg-type, return-value]
            unused=lambda: self.unused.append(name) if name in self.store else None,
        )

    def fill(self, handle: tensor_pb2.Handover, payload: torch.Tensor) -> bool:
        if not self.fills or handle.shm not in self.store:
            return False
        self.store[handle.shm].copy_(payload)
        return True


def handing(fake: FakeHandover, site: str = SITE) -> Handing:
    h = Handing(StageMetrics("p"), make=lambda _device: fake, site_of=lambda _device: site)
    h.serve(torch.device("cpu"))
    return h


def outgoing(h: Handing, t: torch.Tensor) -> Outgoing:
    header, payload = codec.encode_payload(t, "inputs")
    return Outgoing(header, payload, TorchHostCopies(), h)


async def push(hop: NextHop, outputs: Outgoing, peer: str) -> object:
    call: Onward = PushCall(
        0,
        1,
        Crossing(outputs),
        codec.encode(torch.zeros(2, dtype=torch.long), "targets"),
        accumulate=(1,),
        route=(
            pb.Route(peers=[peer], addresses=[peer], throughput=[1.0]),
            pb.Route(peers=["later"]),
        ),
        need_grad_inputs=True,
    )
    return await hop.send(call, deadline=time.monotonic() + 10)


async def test_a_push_is_handed_over_once_the_replica_answered_the_same_site(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    calls, fake = FakeCalls(sites={"b": SITE, "c": "another host"}), FakeHandover()
    h = handing(fake)
    hop = NextHop(job, "job", 0, None, client_factory=calls.factory(), handing=h)
    t = torch.randn(2, 4, dtype=torch.float64)
    try:
        first = outgoing(h, t)
        await push(hop, first, "b")  # its site unknown yet: the wire
        second = outgoing(h, t)
        await push(hop, second, "b")  # it answered ours: handed over, a slot for the gradient
        await push(hop, outgoing(h, t), "c")  # another site: the wire
        await push(hop, outgoing(h, t), "c")
    finally:
        await hop.close()
    sent = [
        (peer, msg.HasField("handover"), bool(msg.data), reply) for peer, msg, reply in calls.pushed
    ]  # type: ignore[union-attr]
    assert [s[:3] for s in sent] == [
        ("b", False, True),
        ("b", True, False),
        ("c", False, True),
        ("c", False, True),
    ]
    assert [s[3] is not None for s in sent] == [False, True, False, False]
    slot = sent[1][3]
    assert slot is not None and slot.nbytes == t.numel() * 8  # the gradient's, as encoded
    assert slot.handle.shm not in fake.store, "the try's slot is released when it ends"
    handed = calls.pushed[1][1]
    assert isinstance(handed, tensor_pb2.Tensor)
    assert torch.equal(codec.decode(handed, fake.take(handed.handover, handed.nbytes)), t)
    second.release()
    assert fake.store == {}, "the offered outputs go when the push plane releases them"


def test_outputs_are_offered_once_for_every_try_and_released_once() -> None:
    fake = FakeHandover()
    h = handing(fake)
    out = outgoing(h, torch.ones(3, dtype=torch.float64))
    assert out.handed() is out.handed() and len(fake.store) == 1
    assert out.wire() is out.wire() and out.wire().data == torch.ones(3).double().numpy().tobytes()
    out.release()
    out.release()
    assert fake.store == {}


def test_the_sites_learned_and_refusals_keep_the_latest_peers_only() -> None:
    """A push whose route names a fresh peer (a hostile caller's) added one entry for as long
    as the stage was served: the latest `KEPT_PEERS` are kept, one used again among them."""
    h = handing(FakeHandover())
    h.learned("first", SITE)
    h.refused("refuser", HandoverRefused("no room"))
    for i in range(3 * KEPT_PEERS):
        h.learned(f"made-up-{i}", SITE)
        h.refused(f"refused-{i}", HandoverRefused("a made-up peer"))
        if i % 100 == 0:
            h.learned("first", SITE)  # answering again: still near
            h.refused("refuser", HandoverRefused("no room"))  # refusing again: still refused
    assert len(h._sites) == KEPT_PEERS and len(h._refused) == KEPT_PEERS
    assert h.near("first") and f"made-up-{3 * KEPT_PEERS - 1}" in h._sites
    assert "refuser" in h._refused and f"refused-{3 * KEPT_PEERS - 1}" in h._refused
    assert "made-up-0" not in h._sites and "refused-0" not in h._refused


def test_a_replica_without_a_site_hands_nothing_over() -> None:
    h = handing(FakeHandover(), site="")
    h.learned("b", "")
    assert h.handover is None and not h.near("b") and h.forms(["b"]) == (False, True)
    header = codec.encode(torch.zeros(2), "inputs")
    assert h.slot(header, codec.CODEC_NONE, 2048) is None
    with pytest.raises(HandoverRefused, match="no handover site"):  # the caller: the wire
        h.take(0, header)


@pytest.mark.parametrize("fills", [True, False])
def test_a_gradient_goes_into_the_callers_slot_when_it_opens(fills: bool) -> None:
    fake = FakeHandover(fills=fills)
    messages = Messages(Limits(), StageMetrics("p"))
    messages.handing = handing(fake)
    grad = torch.randn(2, 3, dtype=torch.float64)
    slot = messages.handing.slot(codec.encode(grad, "outputs"), codec.CODEC_NONE, 2048)
    assert slot is not None
    [msg] = messages.encode(grad, "grad_inputs", codec.CODEC_NONE, "backward", slot.handle)
    if fills:  # no bytes in the answer: the caller reads its slot
        assert msg.HasField("handover") and not msg.data and msg.nbytes == 48
        assert torch.equal(codec.decode(msg, slot.read()), grad)
    else:  # the slot did not open from here: the bytes go on the wire
        assert not msg.HasField("handover") and torch.equal(codec.decode(msg), grad)


def next_hop(tmp_path: Path, calls: FakeCalls, fake: FakeHandover) -> tuple[Handing, NextHop]:
    """A replica of stage 0 (of 3) handing over through `fake`, pushing to `calls`' replicas."""
    job = make_job(tmp_path, training={"stages": 3}, runtime={"data_plane": "push"})
    h = handing(fake)
    return h, NextHop(job, "job", 0, None, client_factory=calls.factory(), handing=h)


def handed_forms(calls: FakeCalls) -> list[tuple[str, bool, bool]]:
    """Each push's (replica, handed over, with a slot)."""
    forms = []
    for peer, msg, reply in calls.pushed:
        assert isinstance(msg, tensor_pb2.Tensor)
        forms.append((peer, msg.HasField("handover"), reply is not None))
    return forms


async def test_a_refused_handover_is_sent_again_on_the_wire_in_the_same_try(
    tmp_path: Path,
) -> None:
    # b answered our site, so the second push is handed over; b refuses it (it could not take
    # the handle: HandoverRefused, it took nothing). Within that try the same push goes to b on
    # the wire, b is not in backoff, and every later push to b goes on the wire though b still
    # answers our site.
    calls, fake = FakeCalls(sites={"b": SITE}), FakeHandover()
    h, hop = next_hop(tmp_path, calls, fake)
    t = torch.randn(2, 4, dtype=torch.float64)
    try:
        await push(hop, outgoing(h, t), "b")
        calls.fail_next("b", HandoverRefused("handover refused: tensor 'inputs': a bad handle"))
        refused = outgoing(h, t)
        done = await push(hop, refused, "b")
        later = outgoing(h, t)
        await push(hop, later, "b")
        assert hop.routes.wiring[1].backoff_until("b") is None, "b is not at fault"
    finally:
        await hop.close()
    assert isinstance(done, Pushed) and done.path == ["b"]
    assert handed_forms(calls) == [
        ("b", False, False),
        ("b", True, True),
        ("b", False, False),
        ("b", False, False),
    ]
    assert not h.near("b")
    refused.release()
    later.release()
    assert fake.store == {}, "the refused offer and its slot are released"
    # neither the refused outputs nor that try's slot were mapped: their counts given back
    [(_, handed, slot)] = [p for p in calls.pushed if p[1].HasField("handover")]  # type: ignore[union-attr]
    assert isinstance(handed, tensor_pb2.Tensor) and slot is not None
    assert sorted(fake.unused) == sorted([handed.handover.shm, slot.handle.shm])


async def test_a_refusal_of_bytes_on_the_wire_is_a_failure_as_any(tmp_path: Path) -> None:
    # Only a handed-over push is sent again: "refused" on the wire is a failure (b is in backoff).
    calls = FakeCalls()
    h, hop = next_hop(tmp_path, calls, FakeHandover())
    calls.fail_next("b", HandoverRefused("handover refused: nothing was handed over"))
    try:
        with pytest.raises(PeerUnavailable, match="no replica took the microbatch"):
            await push(hop, outgoing(h, torch.ones(2, dtype=torch.float64)), "b")
        assert hop.routes.wiring[1].backoff_until("b") is not None
    finally:
        await hop.close()


async def pushed_twice(
    tmp_path: Path, fake: FakeHandover, error: Exception | None = None
) -> tuple[Handing, FakeCalls]:
    """Two pushes to b, which answers our site (so the second is handed over), `error` (if
    any) b's answer to the second's first try; its outputs released when it ended."""
    calls = FakeCalls(sites={"b": SITE})
    h, hop = next_hop(tmp_path, calls, fake)
    t = torch.randn(2, 4, dtype=torch.float64)
    try:
        await push(hop, outgoing(h, t), "b")
        if error is not None:
            calls.fail_next("b", error)
        out = outgoing(h, t)
        await push(hop, out, "b")
        out.release()
    finally:
        await hop.close()
    return h, calls


class FailingOffers(FakeHandover):
    def offer(self, payload: torch.Tensor) -> Offer:
        raise RuntimeError("cannot share this storage")


async def test_a_replica_that_cannot_offer_sends_on_the_wire(tmp_path: Path) -> None:
    h, calls = await pushed_twice(tmp_path, FailingOffers())  # near, but the offer fails
    assert handed_forms(calls) == [("b", False, False), ("b", False, False)]
    assert h.forms(["b"]) == (False, True), "nothing handed over from then on"


async def test_what_a_replica_took_is_not_given_back_and_an_unfilled_slot_is(
    tmp_path: Path,
) -> None:
    # b takes the handed-over outputs (mapped: torch counts on it to give them back) and
    # answers its gradient with bytes (its slot never mapped: the owner gives its count back).
    fake = FakeHandover()
    _, calls = await pushed_twice(tmp_path, fake)
    [slot] = [slot for _, _, slot in calls.pushed if slot is not None]
    assert handed_forms(calls)[1] == ("b", True, True)
    assert fake.unused == [slot.handle.shm]
    assert fake.store == {}


async def test_a_busy_replicas_slot_is_given_back_and_the_next_try_hands_over_again(
    tmp_path: Path,
) -> None:
    fake = FakeHandover()
    _, calls = await pushed_twice(tmp_path, fake, Busy("b: 4 microbatches queued"))
    slots = [slot for _, _, slot in calls.pushed if slot is not None]
    assert handed_forms(calls)[1:] == [("b", True, True), ("b", True, True)]
    assert fake.unused == [s.handle.shm for s in slots], "busy, then answered with bytes"
    assert fake.store == {}


def test_a_refusal_and_the_sites_learned_hold_for_the_stage_served_only() -> None:
    """Kept across jobs, they grew with every job's next replicas, and a peer that refused
    once went on the wire in every later job."""
    handing = Handing(StageMetrics("p"), make=lambda _d: None, site_of=lambda _d: "site")  # type: ignore[arg-type,return-value]
    handing.serve(torch.device("cpu"))
    handing.learned("next", "site")
    handing.refused("next", HandoverRefused("no room"))
    assert (handing._sites, handing._refused) == ({}, {"next": None})
    handing.learned("other", "site")
    handing.serve(torch.device("cpu"))  # the next job's stage (or a move)
    assert (handing._sites, handing._refused) == ({}, {})
