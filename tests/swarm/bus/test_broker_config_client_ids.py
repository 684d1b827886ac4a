"""Issue 44 N2, on real Mosquitto as `swarm broker-config` writes it: a client id is its user's
(`use_username_as_clientid`), so a peer that sends the scheduler's client id, or another peer's,
takes no one's place: the scheduler and that peer stay connected, and no last-will fires."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.bus.topics import ANY, SCHEDULER_USER, Topics
from swarm.proto import control_pb2 as pb
from tests.support.buses import WAIT_S, bus, login, receive_until
from tests.support.mosquitto import SCHEDULER_TOKEN, TOKEN, written_mosquitto

pytestmark = pytest.mark.timeout(90)

PASSWORDS = {"gpu1": "gpu1-own", "gpu2": "gpu2-own"}
TOPICS = Topics()
TAKEOVER = "already connected, closing old connection"  # Mosquitto's line for a kicked client


@pytest.mark.attack("N2")
@pytest.mark.parametrize("taken", [SCHEDULER_USER, "peer-gpu2"])
async def test_a_peer_sending_another_clients_id_takes_no_ones_place(
    tmp_path: Path, broker_certs: Path, taken: str
) -> None:
    # peers gpu1 and gpu2 with passwords of their own, and trainers t1 and t2
    with written_mosquitto(tmp_path, broker_certs, PASSWORDS, trainers=["t1", "t2"]) as broker:
        url, log = broker.url, broker.log
        scheduler = login(url, SCHEDULER_USER, SCHEDULER_TOKEN, client_id=SCHEDULER_USER)
        will = (TOPICS.peer("gpu2"), pb.PeerAnnouncement(peer="gpu2", state=pb.PEER_STATE_OFFLINE))
        gpu2 = bus(url, "peer-gpu2", will=will, token=PASSWORDS["gpu2"], username="gpu2")
        async with scheduler, gpu2:
            await scheduler.wait_connected(WAIT_S)
            seen = scheduler.subscribe(TOPICS.peer(ANY))
            await seen.wait_subscribed(WAIT_S)
            await gpu2.wait_connected(WAIT_S)
            online = pb.PeerAnnouncement(peer="gpu2", state=pb.PEER_STATE_JOINING, address="a:1")
            await gpu2.publish(TOPICS.peer("gpu2"), online, retain=True)
            await receive_until(seen, lambda t, m: t == TOPICS.peer("gpu2"))

            # gpu1, with its own password, sends the taken client id; no reconnecting back.
            attacker = await broker.connect("gpu1", PASSWORDS["gpu1"], client_id=taken)
            async with attacker:
                # gpu2 says something after the attack: the scheduler hears it, and before it
                # no offline will (a kicked gpu2's) on gpu2's topic.
                after = pb.PeerAnnouncement(peer="gpu2", state=pb.PEER_STATE_JOINING, address="b:2")
                await gpu2.publish(TOPICS.peer("gpu2"), after, retain=True)
                heard: list[pb.PeerAnnouncement] = []

                def done(topic: str, message: object) -> bool:
                    if topic == TOPICS.peer("gpu2") and isinstance(message, pb.PeerAnnouncement):
                        heard.append(message)
                        return message.address == "b:2"
                    return False

                await receive_until(seen, done)
                assert [m.state for m in heard if m.state == pb.PEER_STATE_OFFLINE] == []
                assert scheduler.connected and gpu2.connected
                assert TAKEOVER not in log.read_text(), log.read_text()


async def test_trainers_with_users_of_their_own_stay_connected_together(
    tmp_path: Path, broker_certs: Path
) -> None:
    """Each trainer dials with its user in the URL (the token its password), as
    `client.trainer.load_followed` does: both read the swarm, neither replaces the other."""
    # peers gpu1 and gpu2 with passwords of their own, and trainers t1 and t2
    with written_mosquitto(tmp_path, broker_certs, PASSWORDS, trainers=["t1", "t2"]) as broker:
        url, log = broker.url, broker.log
        scheduler = login(url, SCHEDULER_USER, SCHEDULER_TOKEN, client_id=SCHEDULER_USER)
        trainers = [
            bus(url.replace("//", f"//{user}@"), f"trainer-{user}-load", token=TOKEN)
            for user in ("t1", "t2")
        ]
        async with scheduler, trainers[0], trainers[1]:
            subs = []
            for trainer in trainers:
                await trainer.wait_connected(WAIT_S)
                subs.append(trainer.subscribe(TOPICS.steps("j")))
                await subs[-1].wait_subscribed(WAIT_S)
            await scheduler.wait_connected(WAIT_S)
            await scheduler.publish(TOPICS.steps("j"), pb.StepCommitted(step=3), retain=True)
            for sub in subs:
                await receive_until(sub, lambda t, m: t == TOPICS.steps("j"))
            assert all(t.connected for t in trainers)
        assert TAKEOVER not in log.read_text(), log.read_text()
