"""`swarm status` shows the bytes per token that crossed each boundary each way, from the real
path: stage servers under a scheduler count what they send, their load reports carry it, the
scheduler's status and gauge sum it (issue 52, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from client.live import status_lines
from scheduler.collector import collector
from tests.support.scheduled import AMQTT_LEAKS, LONG_SPEC, WAIT_S, scheduled_swarm
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), AMQTT_LEAKS]

# LONG_SPEC's boundary: d_model 32 float64 values per token, uncompressed, both ways.
PER_TOKEN = "256.0"


async def test_status_and_gauge_show_bytes_per_token_per_boundary(tmp_path: Path) -> None:
    async with scheduled_swarm(tmp_path) as swarm:
        job = await swarm.start_job(LONG_SPEC, tmp_path)

        def row() -> list[str] | None:
            lines = status_lines(swarm.status(job), events=0)
            at = [i for i, line in enumerate(lines) if line.startswith("boundaries")]
            return lines[at[0] + 2].split() if at and len(lines) > at[0] + 2 else None

        def both_ways() -> bool:
            got = row()
            return got is not None and "-" not in got

        await wait_until(both_ways, lambda: f"both ways reported: {row()}", timeout_s=WAIT_S)
        assert row() == ["0|1", PER_TOKEN, PER_TOKEN]
        metrics = CollectorRegistry()
        metrics.register(collector(swarm.scheduler))
        got = {
            (s.labels["boundary"], s.labels["direction"]): s.value
            for family in metrics.collect()
            if family.name == "swarm_scheduler_boundary_bytes_per_token"
            for s in family.samples
            if s.labels["job"] == job
        }
        assert got == {("0|1", "forward"): 256.0, ("0|1", "backward"): 256.0}
