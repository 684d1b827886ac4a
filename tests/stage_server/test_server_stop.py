"""A stage server's stop waits for what still runs on its worker pool (a measurement, a stage
being built) off its event loop: the loop goes on meanwhile, so a second SIGTERM or SIGINT is
still heard and exits at once (`swarm.ops.lifecycle`). Waited for on the loop, as it was, a
measurement that waited on another peer's lock held the process past every signal but
SIGKILL."""

from __future__ import annotations

import asyncio
import threading

from stage_server.server import StageServerOptions, start_grpc


async def test_the_worker_pool_is_waited_for_off_the_event_loop() -> None:
    running = await start_grpc(StageServerOptions(stage=0), 64 << 20)
    ends = threading.Event()
    running.executor.submit(ends.wait, 30)  # a measurement still running as the stop comes
    threading.Timer(0.5, ends.set).start()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    stopping = asyncio.create_task(running.stop())
    await asyncio.sleep(0.3)
    assert not stopping.done(), "the stop waits for the pool's work"
    assert ticks >= 5, f"the event loop ran {ticks} times in 0.3 s of the stop"
    await asyncio.wait_for(stopping, 10)
    ticker.cancel()
