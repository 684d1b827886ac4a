"""`--compile-stage`: a stage compiled on CUDA only; eager stays the CPU path and the reference
(`swarm.device.compiled`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_server.replica.runtime import StageRuntime
from stage_server.server import StageServerOptions, start_stage_server
from swarm.device.compiled import CompiledRuns, Run, compiles
from swarm.device.standin import traced
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job


def test_only_a_cuda_stage_that_asks_is_compiled() -> None:
    assert compiles(True, torch.device("cuda", 0))
    assert not compiles(False, torch.device("cuda", 0))
    assert not compiles(True, torch.device("cpu"))  # eager: the CPU path and the reference
    assert not compiles(True, torch.device("mps"))


def test_a_stage_compiled_through_the_cpu_stand_in_computes_what_the_eager_one_does(
    tmp_path: Path,
) -> None:
    # The logic a CUDA stage runs compiled (each module compiled once, on first use; its
    # forward and backward through the compiled graph), on a CPU: torch's tracer, eager kernels.
    job = make_job(tmp_path)
    eager, compiled = StageRuntime(job, 1), StageRuntime(job, 1)
    made: list[torch.nn.Module] = []

    def compile(module: torch.nn.Module) -> Run:
        made.append(module)
        return traced(module)

    compiled.compiled = CompiledRuns(compile)
    gen = torch.Generator().manual_seed(0)
    for index in range(3):  # the first compiles; the others reuse it
        x = torch.randn(4, 16, 32, generator=gen, dtype=torch.float64)
        g = torch.randn(4, 16, 32, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(
            compiled.forward(0, index, Crossing(x)), eager.forward(0, index, Crossing(x))
        )
        ga, _ = eager.backward(0, index, None, g)
        gb, _ = compiled.backward(0, index, None, g)
        assert ga is not None and gb is not None
        torch.testing.assert_close(gb, ga)
    assert made == [compiled.module]
    sums_a, sums_b = eager.prepare(0, [0, 1, 2], 12), compiled.prepare(0, [0, 1, 2], 12)
    for a, b in zip(sums_a, sums_b, strict=True):
        torch.testing.assert_close(b, a)


async def test_a_cpu_server_asked_to_compile_stays_eager(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    running = await start_stage_server(job, StageServerOptions(stage=0, compile_stage=True))
    try:
        assert running.runtime.compiled is None
    finally:
        await running.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_compiled_cuda_stage_computes_what_the_eager_one_does(tmp_path: Path) -> None:
    job = make_job(tmp_path, training={"precision": "bf16-mixed", "dtype": "float32"})
    eager, compiled = StageRuntime(job, 1, "cuda:0"), StageRuntime(job, 1, "cuda:0")
    compiled.compiled = CompiledRuns()
    gen = torch.Generator().manual_seed(0)
    for index in range(3):  # the first compiles; the others reuse it
        x = torch.randn(4, 16, 32, generator=gen).cuda()
        g = torch.randn(4, 16, 32, generator=gen).cuda()
        a, b = eager.forward(0, index, Crossing(x)), compiled.forward(0, index, Crossing(x))
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)  # bf16 rounding, fused
        ga, _ = eager.backward(0, index, None, g)
        gb, _ = compiled.backward(0, index, None, g)
        assert ga is not None and gb is not None
        torch.testing.assert_close(gb, ga, rtol=5e-2, atol=5e-2)
    sums_a = eager.prepare(0, [0, 1, 2], 12)
    sums_b = compiled.prepare(0, [0, 1, 2], 12)
    for a, b in zip(sums_a, sums_b, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)
