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
from swarm.model.footprint import layer_activation_bytes
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
    rt.forward(0, 0, inputs)  # whatever the stage makes once and keeps is made here
    before = {id(t) for t in _live_tensors()}
    rt.forward(0, 1, inputs)
    graph = [weakref.ref(t) for t in _live_tensors() if id(t) not in before]
    assert len(graph) > 2  # the saved activations, not only the leaf input and the output
    for index in range(2, 6):  # (0, 1) is dropped by the count bound
        rt.forward(0, index, inputs)
    assert sorted(rt._cache) == [(0, 4), (0, 5)]
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
