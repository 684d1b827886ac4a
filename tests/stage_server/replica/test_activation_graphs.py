"""A kept forward's graph is freed when the cache drops it, and autograd's checks still hold on
what the cache counted (`stage_server.replica.activation_cache.ActivationCache.counting`)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from stage_server.replica.activation_cache import ActivationCache
from stage_server.replica.runtime import StageRuntime
from swarm.device.activation_bytes import DeviceFootprint, Footprint, measured_on_device
from swarm.device.standin import StandInMemory
from swarm.model.footprint import layer_activation_bytes
from swarm.model.transformer import precision
from swarm.wire.crossing import Crossing
from tests.support.jobs import make_job


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    # by type, not isinstance: some of torch's objects warn when asked their `__class__`
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


@pytest.mark.timeout(60)
def test_the_graphs_of_forwards_dropped_past_the_bound_are_freed(tmp_path: Path) -> None:
    job = make_job(tmp_path, runtime={"activation_cache": 2})
    rt = StageRuntime(job, 1)
    inputs = torch.randn(4, 16, 32, dtype=torch.float64)
    rt.forward(0, 0, Crossing(inputs))  # whatever the stage makes once and keeps is made here
    before = {id(t) for t in _live_tensors()}
    rt.forward(0, 1, Crossing(inputs))
    graph = [weakref.ref(t) for t in _live_tensors() if id(t) not in before]
    assert len(graph) > 2  # the saved activations, not only the leaf input and the output
    for index in range(2, 6):  # (0, 1) is dropped by the count bound
        rt.forward(0, index, Crossing(inputs))
    assert sorted(rt._cache) == [(0, 4, ""), (0, 5, "")]
    assert rt.cache_evictions == 4  # (0, 0)..(0, 3), each dropped to the count bound
    gc.collect()
    alive = [r() for r in graph if r() is not None]
    assert not alive, f"{len(alive)} of {len(graph)} tensors of a dropped forward are still alive"


def test_the_graph_of_a_dropped_tanh_is_freed() -> None:
    cache = ActivationCache()
    x = torch.randn(8, requires_grad=True)
    with cache.counting():
        y = x.tanh()  # saves its own output: the graph would hold itself
        z = torch.softmax(y, 0)
    refs = [weakref.ref(y), weakref.ref(z)]
    del y, z
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_saved_tensor_modified_in_place_still_fails_the_backward() -> None:
    cache = ActivationCache()
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    with cache.counting():
        y = x.tanh()  # its backward reads y
        w = x * 2
        v = w.sin()  # its backward reads w
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    w.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        v.sum().backward()


def test_a_cached_backward_equals_autograd_without_the_cache() -> None:
    cache = ActivationCache()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 5, dtype=torch.float64))

    def loss() -> torch.Tensor:
        h = torch.tanh(x @ w.t())
        return torch.log_softmax(h.transpose(0, 1), 0).exp().relu().sum()

    loss().backward()
    plain = (x.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    x.grad, w.grad = None, None
    with cache.counting() as footprint:
        out = loss()
    out.backward()
    assert footprint.nbytes > 0
    assert torch.equal(x.grad, plain[0]) and torch.equal(w.grad, plain[1])  # type: ignore[arg-type]


def test_counting_a_model_on_the_meta_device_keeps_no_graph(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    layer_activation_bytes(job)  # whatever is made once
    before = {id(t) for t in _live_tensors()}
    layer_activation_bytes(job)
    left = [t for t in _live_tensors() if id(t) not in before]
    assert not left, f"{len(left)} meta tensors outlive the count: {[t.shape for t in left]}"


def test_a_forward_on_cuda_is_counted_by_its_allocator_and_elsewhere_by_hooks() -> None:
    assert measured_on_device(torch.device("cuda", 0))
    assert not measured_on_device(torch.device("cpu"))
    assert not measured_on_device(torch.device("meta"))
    with ActivationCache().counting(torch.device("cpu")) as footprint:
        x = torch.randn(8, dtype=torch.float64, requires_grad=True)
        y = x.tanh()
    assert isinstance(footprint, Footprint) and footprint.nbytes == 64  # y, saved by tanh
    del y


def test_the_allocator_s_count_is_what_the_forward_left_plus_its_input() -> None:
    # CUDA's arithmetic on a CPU, through the stand-in's count: no hook runs per saved tensor;
    # the footprint is the count after the forward less before it, plus the input (allocated
    # before), the output counted once already; a forward during which more was freed (another
    # thread's release) counts nothing, never less.
    device, memory = torch.device("cpu"), StandInMemory(1 << 30)
    memory.allocate(5000)  # the stage's weights and what came before
    assert measured_on_device(device, memory)
    assert not measured_on_device(device, StandInMemory(1 << 30, counts=False))
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    packed = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packed
        packed += 1
        return t

    cache = ActivationCache()
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        cache.counting(device, memory) as counted,
    ):
        y = x.tanh()
        memory.allocate(1234)  # what the forward left allocated: saved tensors, output
    assert isinstance(counted, DeviceFootprint) and packed == 1  # the cache set no hooks
    counted.add_input(x)
    counted.add_output(y)  # counted already
    assert counted.nbytes == 1234 + 64
    with cache.counting(device, memory) as freed:
        memory.allocate(-3000)
    freed.add_input(x)
    assert freed.nbytes == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_allocator_counts_what_the_hooks_would_with_no_python_per_tensor(
    tmp_path: Path,
) -> None:
    job = make_job(tmp_path, training={"precision": "bf16-mixed", "dtype": "float32"})
    rt = StageRuntime(job, 1, device="cuda:0")
    inputs = torch.randn(4, 16, 32, device="cuda:0")
    rt.forward(
        0, 0, Crossing(inputs)
    )  # what the stage makes once (RoPE tables, the allocator's pools)
    hooks = ActivationCache()
    x = inputs.detach().requires_grad_(True)
    with torch.enable_grad(), precision(job, rt.device), hooks.counting() as counted:
        out = rt.module(x)
    counted.add_input(x)
    counted.add_output(out)
    packed = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packed
        packed += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rt.forward(0, 1, Crossing(inputs))  # counted by the allocator: no hook of the cache's runs
    assert packed > 0  # the innermost hooks win: had the cache set its own, none came here
    measured = rt._cache._entries[(0, 1, "")][1]
    assert measured == pytest.approx(counted.nbytes, rel=0.25), (measured, counted.nbytes)
