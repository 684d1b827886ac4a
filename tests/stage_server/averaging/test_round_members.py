"""Only a round's members reduce (`swarm.net.round_tickets`): an owner whose replicas a scheduler
placed takes a contribution as sender i only with the scheduler's round ticket placing the caller
there. Before, any token holder could send a part as any sender of any round, begun or not:
plant what an owner sums and reports, abort a round naming its honest members, or hold every
open round of an owner on made-up ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from stage_server.averaging.owner import Averager
from swarm.net.round_tickets import RoundPass, issue_round_ticket
from swarm.proto import pool_pb2, pool_pb2_grpc
from swarm.wire import chunking as wire
from tests.support import pools
from tests.support.pools import JOB, MiB, Replica

pytestmark = [pytest.mark.attack("round-members"), pytest.mark.timeout(120)]

N, PART = 300, 100  # three members, equal parts of 100 values each
ROUND = "7/0"


def _passes(key: Ed25519PrivateKey, n: int = 3, round: str = ROUND) -> list[RoundPass]:
    """Each member's side of the ticket its PREPARE would give it."""
    peers = pools.peer_ids(n)
    made = [
        issue_round_ticket(
            key,
            job=JOB,
            stage=0,
            round=round,
            sender=i,
            peers=peers,
            contributors=0,
            now=time.time(),
        )
        for i in range(n)
    ]
    return [RoundPass(t, peers) for t in made]


def _stranger(
    owner: Replica,
    *,
    part: int,
    sender: int,
    values: torch.Tensor,
    timeout: float,
    round: str = ROUND,
    proof: pool_pb2.MemberProof | None = None,
    group_size: int = 3,
) -> asyncio.Task[Any]:
    """A contribution to `owner` as `sender` of `round`, the swarm token its only credential
    (`proof`: one it holds of another's); its task ends with the answer or the call's error."""

    async def call() -> Any:
        async with grpc.aio.insecure_channel(owner.address) as channel:
            header = pool_pb2.PoolReduceRequest(
                job=JOB, stage=0, round=round, part=part, sender=sender, group_size=group_size
            )
            if proof is not None:
                header.proof.CopyFrom(proof)
            reduce = pool_pb2_grpc.PoolServiceStub(channel).Reduce(timeout=timeout)
            for m in wire.split_tensor(header, "part", values, MiB):
                await reduce.write(m)
            await reduce.done_writing()
            return await wire.receive_reply(reduce, max_bytes=64 * MiB)

    return asyncio.create_task(call())


async def _code(task: asyncio.Task[Any]) -> grpc.StatusCode | None:
    try:
        await task
    except grpc.aio.AioRpcError as e:
        return e.code()
    return None


def _flats() -> list[torch.Tensor]:
    return [torch.arange(N, dtype=torch.float64) * (i + 1) for i in range(3)]


def _norms(flats: Sequence[torch.Tensor], part: int) -> list[float]:
    return [float((f[part * PART : (part + 1) * PART] ** 2).sum()) for f in flats]


@pytest.mark.parametrize(
    "deadline", [10.0, 0.05], ids=["plants-its-values", "aborts-on-its-deadline"]
)
async def test_a_stranger_cannot_reduce_as_a_member(deadline: float) -> None:
    # Before: the stranger's part as sender 0 was taken. With a long deadline its values were
    # what the owner held of sender 0 (and reported: the norm bound's evidence); with 50 ms it
    # opened the round's slot, timed out and aborted the round naming the others.
    key = Ed25519PrivateKey.generate()
    flats = _flats()
    async with pools.replicas(3, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        planted = torch.full((PART,), 1e6, dtype=torch.float64)
        stranger = _stranger(pool[1], part=1, sender=0, values=planted, timeout=deadline)
        await asyncio.sleep(0.3)  # its call is in (and, with 50 ms, over) before the round
        results = await pools.reduce_all(pool, flats, round=ROUND, proofs=_passes(key))
        assert await _code(stranger) == grpc.StatusCode.PERMISSION_DENIED
        assert torch.equal(pools.assert_identical(results), pools.ordered_sum(flats))
        assert pool[1].averager.received((JOB, 0, ROUND), 1) == _norms(flats, 1)


async def test_a_members_own_short_deadline_aborts_no_round() -> None:
    # A review's repro: a member (its ticket valid) that opened a part first on a call of 50 ms
    # set that part's deadline to its own: at 45 ms the owner aborted the round, naming the
    # members that had not sent yet, the honest ones, and refused their parts after. Its own
    # call ends at its deadline; the round waits on, for the job's timeout.
    key = Ed25519PrivateKey.generate()
    flats, passes = _flats(), _passes(key)
    async with pools.replicas(3, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        own = flats[0][PART : 2 * PART].clone()  # its own values of part 1, honestly
        early = _stranger(
            pool[1], part=1, sender=0, values=own, timeout=0.05, proof=passes[0].to(1)
        )
        await asyncio.sleep(0.3)  # its call is in, and over, before the round
        # its own call ended (told so just before its deadline, or by it), the round on
        assert await _code(early) in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        results = await pools.reduce_all(pool, flats, round=ROUND, proofs=passes)
        assert torch.equal(pools.assert_identical(results), pools.ordered_sum(flats))


async def test_made_up_rounds_hold_no_place_of_an_owner() -> None:
    # Before: 64 contributions on made-up round ids held every open round of the owner, and
    # the honest round was refused (RESOURCE_EXHAUSTED) until they timed out.
    key = Ed25519PrivateKey.generate()
    flats = _flats()
    async with pools.replicas(3, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        owner = pool[0]
        assert owner.averager._max_open == 64  # the default every replica runs with
        values = torch.zeros(PART, dtype=torch.float64)
        fakes = [
            _stranger(owner, part=0, sender=1, values=values, timeout=30, round=f"{900 + i}/0")
            for i in range(64)
        ]
        await asyncio.sleep(1.0)  # every one of them in before the round
        results = await pools.reduce_all(pool, flats, round=ROUND, proofs=_passes(key))
        assert torch.equal(pools.assert_identical(results), pools.ordered_sum(flats))
        codes = {await _code(f) for f in fakes}
        assert codes == {grpc.StatusCode.PERMISSION_DENIED}, codes


async def test_a_members_proof_is_for_its_owner_only_and_the_schedulers_alone() -> None:
    # An owner learns the secret meant for it: replayed to another owner it is refused, and so
    # is a ticket signed by anyone but the scheduler.
    key = Ed25519PrivateKey.generate()
    async with pools.replicas(3, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        values = torch.zeros(PART, dtype=torch.float64)
        seen_by_1 = _passes(key)[0].to(1)  # member 0's proof, as owner 1 received it
        replayed = _stranger(pool[2], part=2, sender=0, values=values, timeout=10, proof=seen_by_1)
        assert await _code(replayed) == grpc.StatusCode.PERMISSION_DENIED
        forged = _passes(Ed25519PrivateKey.generate())[0].to(2)
        forger = _stranger(pool[2], part=2, sender=0, values=values, timeout=10, proof=forged)
        assert await _code(forger) == grpc.StatusCode.PERMISSION_DENIED
        assert isinstance(pool[2].averager, Averager)
        assert pool[2].averager.received((JOB, 0, ROUND), 2) == []  # nothing of them summed


async def test_an_owner_no_scheduler_placed_takes_the_token_as_before() -> None:
    # `swarm trainer --stage-servers`: its owner coordinates the pool, and no ticket is asked.
    flats = _flats()
    async with pools.replicas(3) as pool:
        results = await pools.reduce_all(pool, flats)
        assert torch.equal(pools.assert_identical(results), pools.ordered_sum(flats))


async def test_a_group_past_its_bound_is_refused_before_its_ticket_is_read() -> None:
    # A ticket carries a digest per member, as many as the header's group: one naming a group
    # of a million (whose proof could be 32 MB of digests) is refused for the group's size
    # first, as the owner refuses it later anyway, not for its ticket once that was hashed.
    key = Ed25519PrivateKey.generate()
    values = torch.zeros(4, dtype=torch.float64)
    async with pools.replicas(1, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        huge = _stranger(pool[0], part=0, sender=0, values=values, timeout=10, group_size=1 << 20)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await huge
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "above 1024" in (refused.value.details() or "")


async def test_an_owners_secret_replayed_to_another_owner_as_its_part_is_refused() -> None:
    # A hostile owner holds each member's secret for its own part. Before, another owner took
    # it as a contribution to that part: the ticket bound the secret to a part number, not to
    # the owner, so owner 2 opened a slot for part 1 (which no member sends it), and on the
    # call's deadline aborted its round, naming the honest members it waited for.
    key = Ed25519PrivateKey.generate()
    flats = _flats()
    async with pools.replicas(3, scheduler_key=key.public_key().public_bytes_raw()) as pool:
        passes = _passes(key)
        seen_by_1 = passes[0].to(1)  # member 0's proof, as owner 1 received it
        values = torch.zeros(PART, dtype=torch.float64)
        replayed = _stranger(
            pool[2], part=1, sender=0, values=values, timeout=0.05, proof=seen_by_1
        )
        await asyncio.sleep(0.3)  # its call is in, and over, before the round
        results = await pools.reduce_all(pool, flats, round=ROUND, proofs=passes)
        assert await _code(replayed) == grpc.StatusCode.PERMISSION_DENIED
        assert torch.equal(pools.assert_identical(results), pools.ordered_sum(flats))
