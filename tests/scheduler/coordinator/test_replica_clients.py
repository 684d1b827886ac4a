"""A coordinator's connections to its replicas (`ReplicaClients`): one dropped or no longer a
member waits out a grace before it is closed (calls in flight run to their deadlines); the
coordinator's close closes those too, at once. It cancelled their waits and closed only the
open ones: every replica dropped in a job's last grace (`commit_timeout_s`, two minutes) kept
its channels until the collector came (a review found it)."""

from __future__ import annotations

from typing import Any

from scheduler.coordinator.replicas import ReplicaClients
from swarm.rpc.lease import Replica


class Client:
    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed

    async def close(self) -> None:
        self.closed.append(self.name)


async def test_the_close_closes_the_clients_waiting_out_their_grace_too() -> None:
    closed: list[str] = []

    def factory(stage: int, replica: Replica) -> Any:
        return Client(replica.peer, closed)

    clients = ReplicaClients(factory, grace_s=60.0)
    a, b, c = Replica("a", "a:1"), Replica("b", "b:1"), Replica("c", "c:1")
    for replica in (a, b, c):
        clients.get(0, replica)
    clients.drop(0, a)  # did not answer
    await clients.keep([[b]])  # c is no member now
    assert closed == []  # both wait out their grace
    await clients.close()
    assert sorted(closed) == ["a", "b", "c"]
