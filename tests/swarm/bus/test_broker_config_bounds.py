"""Issue 44 N3, on real Mosquitto as `swarm broker-config` writes it: a peer publishing big
retained messages on its load topic, with a subscriber that never reads, grows the broker no
further than the written `memory_limit` (VmRSS, read from /proc); the written file carries the
bounds. (That a peer retains on no more than its two topics: test_broker_config_load_topics.)"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from swarm.bus.broker_config import MEMORY_LIMIT_MIB, conf_text
from swarm.bus.topics import Topics
from tests.support.mosquitto import written_mosquitto
from tests.support.raw_mqtt import packet, publish_packet

pytestmark = [pytest.mark.timeout(120), pytest.mark.attack("N3")]

TOPICS = Topics()
FLOOD = 300  # retained messages, each just under the packet cap: 570 MiB in all
SIZE = int(1.9 * 2**20)
SLACK_MIB = 100  # what Mosquitto's memory_limit does not count: the process, OpenSSL's buffers
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP = 0x82, 0x90, 0xC0, 0xD0


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _pid_running(conf: Path) -> int:
    """The process started with `conf` on its command line (`running` keeps its Popen)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(conf).encode() in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no process runs {conf}")


def _subscribe(pattern: str) -> bytes:
    name = pattern.encode()
    return packet(SUBSCRIBE, struct.pack("!HH", 1, len(name)) + name + b"\x00")


def test_the_written_conf_bounds_queues_heap_and_packets() -> None:
    conf = conf_text(Path("/etc/swarm/broker"), 8883, user="mosquitto", mutual=False)
    settings = dict(
        line.split(None, 1) for line in conf.splitlines() if line and not line.startswith("#")
    )
    assert int(settings["max_queued_messages"]) > 0
    assert int(settings["max_queued_bytes"]) > 0
    assert int(settings["memory_limit"]) == MEMORY_LIMIT_MIB << 20
    assert int(settings["max_packet_size"]) == 2 << 20
    assert settings["use_username_as_clientid"] == "true"  # N2


async def test_a_retained_flood_and_a_subscriber_that_never_reads_stay_bounded(
    tmp_path: Path, broker_certs: Path
) -> None:
    with written_mosquitto(tmp_path, broker_certs, {"a": None, "b": None}) as broker:
        log = broker.log
        pid = _pid_running(broker.files[0])
        async with await broker.connect("b") as never_reads, await broker.connect("a") as flooder:
            await never_reads.send(_subscribe(TOPICS.everything()))
            suback = await asyncio.wait_for(never_reads.reader.readexactly(5), 10.0)
            assert suback[0] == SUBACK and suback[-1] == 0, suback  # then it reads no more
            sent = 0
            payload = b"x" * SIZE
            try:
                for _ in range(FLOOD):
                    await flooder.send(publish_packet(TOPICS.load("a"), payload, retain=True))
                    sent += 1
                # Whatever it took is in the broker once a ping behind the flood is answered.
                await flooder.send(packet(PINGREQ, b""))
                pong = await asyncio.wait_for(flooder.reader.readexactly(2), 60.0)
                assert pong[0] == PINGRESP, pong
            except (OSError, asyncio.IncompleteReadError):  # ssl.SSLError is an OSError
                pass  # the broker disconnected it: what a bound does
            rss = _rss_mib(pid)
            assert rss < MEMORY_LIMIT_MIB + SLACK_MIB, (
                f"Mosquitto holds {rss} MiB after {sent} x {SIZE / 2**20:.1f} MiB retained\n"
                + log.read_text()[-2000:]
            )
