"""A taken port at each bind site (gRPC, /metrics, the embedded broker) raises `PortInUse` for its
listener, and `naming` turns it into the line naming the flag. With processes:
tests/system/test_ports.py."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from swarm.bus.broker import EmbeddedBroker
from swarm.errors import SwarmError
from swarm.net.ports import Listener, PortFlag, PortInUse, naming
from swarm.net.tokens import add_port
from swarm.ops.metrics import serve_metrics
from swarm.wire.chunking import grpc_options
from tests.support.ports import taken_port

FLAG = PortFlag(Listener.METRICS, "--metrics-port", "SWARM_X_METRICS_PORT")


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process listens on."""
    with taken_port() as port:
        yield port


async def test_a_grpc_server_on_a_taken_port_raises_port_in_use(taken: int) -> None:
    server = grpc.aio.server(options=grpc_options(1 << 20))
    with pytest.raises(PortInUse) as caught:
        add_port(server, f"127.0.0.1:{taken}", "a stage server")
    await server.stop(None)
    assert caught.value.listener is Listener.GRPC and caught.value.port == taken


def test_metrics_on_a_taken_port_raise_port_in_use(taken: int) -> None:
    with pytest.raises(PortInUse) as caught:
        serve_metrics(CollectorRegistry(), "127.0.0.1", taken)
    assert caught.value.listener is Listener.METRICS


async def test_the_embedded_broker_on_a_taken_port_raises_port_in_use(
    taken: int, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(PortInUse) as caught:
        await EmbeddedBroker("127.0.0.1", taken).start()
    assert caught.value.listener is Listener.BROKER
    assert "Traceback" not in caplog.text and "startup failed" not in caplog.text


def test_naming_refuses_a_taken_port_before_the_body_runs(taken: int) -> None:
    ran = []
    with pytest.raises(SwarmError) as caught, naming("127.0.0.1", [(FLAG, taken)]):
        ran.append(True)
    assert not ran
    assert str(caught.value) == (
        f"port {taken} is taken (127.0.0.1:{taken}, for its /metrics): another process listens "
        "there (an earlier one still running?): give --metrics-port another port, or 0 for any "
        "free one (SWARM_X_METRICS_PORT)"
    )


def test_naming_names_the_flag_of_a_port_taken_inside(taken: int) -> None:
    wanted = pytest.raises(SwarmError, match="give --metrics-port another port")
    with wanted, naming("127.0.0.1", [(FLAG, 0)]):  # 0: nothing to check first
        raise PortInUse("127.0.0.1", taken, Listener.METRICS)
    with pytest.raises(PortInUse), naming("127.0.0.1", [(FLAG, 0)]):  # no flag for it
        raise PortInUse("127.0.0.1", taken, Listener.GRPC)
