"""A peer's link rates (issue 43, item 1): the meter (`stage_server.bandwidth`) on a moved clock;
an averaging round between two real stage servers measured in both directions, the owner's side
included, and shown as `swarm_peer_link_bytes_per_second`; a stage server started with
`--bandwidth 10M/100M` announcing 1.25e6 / 12.5e6 bytes/s on a real broker."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from stage_server.averaging.butterfly import RoundSettings, all_reduce
from stage_server.bandwidth import LinkMeter, RoundTraffic, fill_rates, material, reannounce
from stage_server.metrics import StageMetrics
from stage_server.server import StageServerOptions, start_stage_server
from swarm.bus.connection import Bus
from swarm.bus.topics import Topics
from swarm.job.fingerprint import fingerprint
from swarm.local.procs import start_process
from swarm.proto import control_pb2 as cpb
from swarm.rpc.stage_client import StageClient
from tests.support.brokers import Mosquitto
from tests.support.jobs import WIDE, make_job, write_job

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_rate_is_bytes_over_seconds_per_direction_and_small_transfers_do_not_count() -> None:
    meter = LinkMeter(clock=Clock())
    assert meter.rates() == (0.0, 0.0)  # unknown until measured
    meter.transferred("up", 512 * 1024, 0.001)  # latency-bound: 500 MB/s it is not
    assert meter.rates() == (0.0, 0.0)
    meter.transferred("up", 10 * MiB, 2.0)
    meter.transferred("down", 4 * MiB, 0.5)
    assert meter.rates() == (5 * MiB, 8 * MiB)
    with pytest.raises(ValueError, match="direction"):
        meter.transferred("sideways", MiB, 1.0)  # type: ignore[arg-type]


def test_the_estimate_is_the_max_of_recent_transfers_and_forgets_old_ones() -> None:
    clock = Clock()
    meter = LinkMeter(clock=clock, keep=3, window_s=60.0)
    meter.transferred("up", 10 * MiB, 1.0)  # 10 MiB/s
    meter.transferred("up", 10 * MiB, 5.0)  # a round that waited on a slower partner: 2 MiB/s
    assert meter.rate("up") == 10 * MiB  # a lower bound does not pull the estimate down
    clock.now += 61  # idle a while: nothing new, the last estimate stays
    assert meter.rate("up") == 2 * MiB  # the newest alone, once none is recent
    meter.transferred("up", 3 * MiB, 1.0)
    assert meter.rate("up") == 3 * MiB  # the link got slower: seen at once after the window
    for _ in range(3):  # and within it, once `keep` newer transfers pushed the fast one out
        meter.transferred("down", 10 * MiB, 1.0)
    meter.transferred("down", MiB, 1.0)
    assert meter.rate("down") == 10 * MiB
    for _ in range(3):
        meter.transferred("down", MiB, 1.0)
    assert meter.rate("down") == MiB


def test_fixed_rates_win_and_zero_leaves_a_direction_measured() -> None:
    meter = LinkMeter(clock=Clock())
    meter.transferred("up", 10 * MiB, 1.0)
    meter.transferred("down", 10 * MiB, 1.0)
    meter.fix(1.25e6, 0.0)
    assert meter.rates() == (1.25e6, 10 * MiB)
    assert meter.measured("up") == 10 * MiB
    with pytest.raises(ValueError):
        meter.fix(-1.0, 0.0)


def test_a_round_counts_its_own_bytes_and_the_owners_of_its_span() -> None:
    clock = Clock()
    meter = LinkMeter(clock=clock)
    rounds = RoundTraffic(meter)
    rounds.served(5 * MiB, 5 * MiB)  # an owner's part of an earlier round: not this one's
    clock.now += 100
    rounds.served(2 * MiB, 3 * MiB)  # during this round
    clock.now += 1
    rounds.counted(4 * MiB, 4 * MiB)  # all_reduce's own, as it ends
    rounds.finished(2.0)
    assert meter.rates() == (3 * MiB, 3.5 * MiB)  # (4 + 2) / 2, (4 + 3) / 2
    rounds.counted(100 * MiB, 100 * MiB)  # a failed round: never finished
    rounds.counted(2 * MiB, 2 * MiB)  # the retry replaces it
    rounds.finished(0.5)
    assert meter.rates() == (4 * MiB, 4 * MiB)
    rounds.finished(0.001)  # no round counted: nothing
    assert meter.rates() == (4 * MiB, 4 * MiB)


def test_what_is_material_to_announce_again() -> None:
    assert material((0.0, 0.0), (1e6, 0.0))  # became known
    assert not material((1e6, 1e6), (1.1e6, 0.9e6))  # within 20 %
    assert material((1e6, 1e6), (1e6, 1.3e6))
    assert not material((0.0, 0.0), (0.0, 0.0))


async def test_rates_are_announced_again_when_they_move_materially() -> None:
    metrics = StageMetrics("p")
    announced: list[tuple[float, float]] = []

    async def announce() -> None:
        msg = cpb.PeerAnnouncement(peer="p")
        fill_rates(msg, metrics)
        announced.append((msg.upload_bytes_per_second, msg.download_bytes_per_second))

    task = asyncio.create_task(reannounce(metrics, announce, period_s=0.01))
    try:
        await asyncio.sleep(0.1)
        assert announced == []  # nothing known: nothing to say
        metrics.moved("up", 10 * MiB, 1.0)
        await _until(lambda: announced == [(10 * MiB, 0.0)])
        metrics.moved("up", 11 * MiB, 1.0)  # +10 %: not material
        await asyncio.sleep(0.1)
        assert announced == [(10 * MiB, 0.0)]
        metrics.moved("down", 8 * MiB, 1.0)
        await _until(lambda: announced[-1:] == [(11 * MiB, 8 * MiB)])
    finally:
        task.cancel()


async def _until(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not announced in time"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(120)
async def test_an_averaging_round_between_two_stage_servers_measures_both_links(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path)
    servers = [await start_stage_server(job, StageServerOptions(stage=0)) for _ in range(2)]
    try:
        group = [s.address for s in servers]
        numel = 2 * MiB  # float32: 8 MiB, a part of 4 MiB each way to each owner
        flats = [torch.full((numel,), float(i + 1)) for i in range(2)]

        async def member(i: int) -> float:
            s = servers[i].servicer
            settings = RoundSettings(
                group=group, index=i, round="r0", job=fingerprint(job), stage=0, timeout_s=60.0,
                chunk_bytes=MiB, max_bytes=64 * MiB,
            )  # fmt: skip
            started = time.monotonic()
            total = await all_reduce(
                flats[i], settings, averager=s.averager, channels=s.channels,
                on_bytes=s.metrics.averaged,
            )  # fmt: skip
            # As the commit does: the round's time after its bytes (stage_server/commit.py).
            seconds = time.monotonic() - started
            s.metrics.averaging_seconds(seconds)
            assert torch.equal(total, torch.full((numel,), 3.0))
            return seconds

        took = await asyncio.gather(member(0), member(1))
        for running, seconds in zip(servers, took, strict=True):
            metrics = running.servicer.metrics
            up, down = metrics.link.rates()
            # Its own part out and the other's sum back (all_reduce), and as the owner of its
            # part the other's contribution in and the sum out (PoolServicer): 8 MiB each way.
            assert up * seconds == pytest.approx(8 * MiB)
            assert down * seconds == pytest.approx(8 * MiB)
            for direction, rate in (("up", up), ("down", down)):
                labels = {"peer": running.address, "direction": direction}
                shown = metrics.registry.get_sample_value(
                    "swarm_peer_link_bytes_per_second", labels
                )
                assert shown == rate
    finally:
        for s in servers:
            await s.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_stage_server_with_a_given_bandwidth_announces_it(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "mosquitto")
    broker.start()
    peer = start_process(
        [
            "stage-server", "--broker", broker.url, "--peer", "p1", "--metrics-port", "0",
            "--bandwidth", "10M/100M",
        ],
        log_dir=tmp_path,
        name="peer",
    )  # fmt: skip
    try:
        ready = await asyncio.to_thread(peer.wait_ready, 120)
        announced = cpb.PeerAnnouncement()
        async with Bus(broker.url, "reader", username="reader") as bus:
            await bus.wait_connected(30)
            async for _, message in bus.subscribe(Topics().peer("p1")):
                assert isinstance(message, cpb.PeerAnnouncement)
                if message.state != cpb.PEER_STATE_OFFLINE:
                    announced = message
                    break
        assert announced.upload_bytes_per_second == 1.25e6
        assert announced.download_bytes_per_second == 12.5e6
        url = f"http://127.0.0.1:{ready['metrics']}/metrics"
        scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        shown = scraped.decode()
        assert 'swarm_peer_link_bytes_per_second{direction="up",peer="p1"} 1.25e+06' in shown
        assert 'swarm_peer_link_bytes_per_second{direction="down",peer="p1"} 1.25e+07' in shown
    finally:
        peer.stop()
        broker.stop()
    assert "Traceback" not in peer.log()


def test_a_bad_bandwidth_is_refused_with_its_reason(tmp_path: Path) -> None:
    from tests.support.cli import swarm

    job = write_job(tmp_path)
    done = swarm(
        "stage-server", "--job", str(job), "--stage", "0", "--bandwidth", "100Mbps",
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "ambiguous" in done.stderr and "100mbit" in done.stderr


@pytest.mark.timeout(180)
async def test_a_state_download_measures_the_joiners_download_and_the_sources_upload(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, model=WIDE)  # stage 0's state: a 32 MiB embedding, and Adam's
    source, joiner = [await start_stage_server(job, StageServerOptions(stage=0)) for _ in "ab"]
    client = StageClient(joiner.address, job, fingerprint(job), 0)
    try:
        deadline = time.monotonic() + 120
        while await client.join(source.address, 0) != 0:  # copied, and following at step 0
            assert time.monotonic() < deadline, "the copy never came"
            await asyncio.sleep(0.05)
        assert joiner.servicer.metrics.link.measured("down") > 0
        assert source.servicer.metrics.link.measured("up") > 0
        assert joiner.servicer.metrics.link.measured("up") == 0  # it sent no state
    finally:
        await client.close()
        for s in (source, joiner):
            await s.stop()


@pytest.mark.timeout(120)
async def test_activations_received_measure_the_download(tmp_path: Path) -> None:
    job = make_job(
        tmp_path,
        model={**WIDE, "seq_len": 256},
        training={"stages": 3, "microbatch_size": 8},
    )  # a middle stage's inputs: 8 x 256 x 256 float64, 4 MiB
    server = await start_stage_server(job, StageServerOptions(stage=1))
    client = StageClient(server.address, job, fingerprint(job), 1)
    try:
        inputs = torch.randn(8, 256, 256, dtype=torch.float64)
        await client.forward(0, 0, inputs)
        assert server.servicer.metrics.link.measured("down") > 0
        assert server.servicer.metrics.link.measured("up") == 0
    finally:
        await client.close()
        await server.stop()
