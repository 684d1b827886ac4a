"""Model, partitioner and data: the pieces whose determinism makes the swarm exact."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from swarm.errors import ConfigError
from swarm.job.schema import MAX_LAYERS, MAX_STAGES
from swarm.model.data import make_data
from swarm.model.transformer import (
    build_model,
    build_stage,
    layer_costs,
    loss_sum,
    num_layers,
    partition,
)
from tests.support.jobs import make_job


def test_partition_is_contiguous_nonempty_and_optimal() -> None:
    costs = [1.0, 5.0, 5.0, 5.0, 5.0, 9.0]
    ranges = partition(costs, 3)
    assert [list(r) for r in ranges] == [[0, 1, 2], [3, 4], [5]]
    for stages in range(1, len(costs) + 1):
        ranges = partition(costs, stages)
        assert [i for r in ranges for i in r] == list(range(len(costs)))
        assert all(len(r) > 0 for r in ranges)
    # brute force over every split into 3: no contiguous split has a smaller bottleneck
    best = min(
        max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:]))
        for a in range(1, 5)
        for b in range(a + 1, 6)
    )
    assert max(sum(costs[i] for i in r) for r in partition(costs, 3)) == best


def test_partition_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ConfigError, match=r"training\.stages"):
        partition([1.0, 1.0], 3)


def _reference_partition(costs: list[float], stages: int) -> list[range]:
    """The partition as swarm computed it before issue 27 (O(stages x layers^2)): the new one
    must give exactly its ranges, or servers of two versions would build different stages."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i] - 1e-9 * value:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(stages)]


def _random_costs(rng: random.Random, n: int) -> list[float]:
    """Cost vectors of every shape that makes ties: floats, small integers (exact ties), zeros,
    a model's shape (embedding, equal blocks, head), and near-ties within the programme's 1e-9."""
    shape = rng.randrange(6)
    if shape == 0:
        return [rng.uniform(0.0, 10.0) for _ in range(n)]
    if shape == 1:
        return [float(rng.randint(0, 3)) for _ in range(n)]
    if shape == 2:
        return [rng.choice([0.0, 1.0, 1e6]) for _ in range(n)]
    if shape == 3:
        block = rng.uniform(1.0, 1e12)
        return ([rng.uniform(0, block)] + [block] * (n - 2) + [rng.uniform(0, 30 * block)])[:n]
    if shape == 4:
        return [1.0 + rng.choice([0.0, 1e-10, 3e-10, 1e-9, 2e-9, 1e-8]) for _ in range(n)]
    return [rng.choice([1e-12, 1e-3, 1.0, 1e3, 1e12]) * rng.random() for _ in range(n)]


def test_partition_gives_exactly_the_ranges_of_the_exact_programme() -> None:
    rng = random.Random(27)
    for _ in range(150):
        n = rng.randint(1, 24)
        costs = _random_costs(rng, n)
        for stages in sorted({1, n, rng.randint(1, n), rng.randint(1, n)}):
            assert partition(costs, stages) == _reference_partition(costs, stages), (costs, stages)
    for n, stages in ((100, 4), (100, 20), (90, 89)):  # longer rows: the windows move far
        for shape in range(6):
            costs = _random_costs(random.Random(shape), n)
            assert partition(costs, stages) == _reference_partition(costs, stages)


def test_partition_of_the_largest_job_the_schema_allows(tmp_path: Path) -> None:
    """At the bounds (MAX_LAYERS blocks over MAX_STAGES stages) the partition is one of the
    smallest bottleneck: the old programme took about 20 minutes here, this one well under a
    second (figures in the issue, not asserted)."""
    job = make_job(
        tmp_path,
        model={"n_layers": MAX_LAYERS, "d_model": 64, "n_heads": 4},
        training={"stages": MAX_STAGES},
    )
    costs = layer_costs(job.model)
    ranges = partition(costs, MAX_STAGES)
    assert [i for r in ranges for i in r] == list(range(MAX_LAYERS + 2))
    assert all(len(r) > 0 for r in ranges)
    bottleneck = max(sum(costs[i] for i in r) for r in ranges)
    # No split has a smaller bottleneck: greedily packing stages under anything smaller needs
    # more than MAX_STAGES of them.
    assert _stages_needed(costs, bottleneck * (1 - 1e-6)) > MAX_STAGES


def _stages_needed(costs: list[float], limit: float) -> float:
    stages, load = 1, 0.0
    for c in costs:
        if c > limit:
            return math.inf
        if load + c > limit:
            stages, load = stages + 1, 0.0
        load += c
    return stages


def test_partition_refuses_costs_that_are_no_costs() -> None:
    for costs in ([1.0, -1.0], [1.0, math.nan], [math.inf, 1.0], [1e308, 1e308]):
        with pytest.raises(ConfigError, match="layer costs"):
            partition(costs, 1)


def test_first_stage_has_embedding_last_has_head(tmp_path: Path) -> None:
    job = make_job(tmp_path, model={"n_layers": 6})
    first, last = build_stage(job, 0), build_stage(job, 3)
    assert first.indices[0] == 0 and any(k.endswith("tok.weight") for k in first.state_dict())
    assert last.indices[-1] == num_layers(job.model) - 1
    assert any(k.endswith("lm_head.weight") for k in last.state_dict())
    assert len(layer_costs(job.model)) == num_layers(job.model)


LLAMA = {"kind": "llama", "n_heads": 4, "n_kv_heads": 2}


@pytest.mark.parametrize("model", [{}, LLAMA], ids=["gpt", "llama"])
def test_stage_built_alone_equals_whole_model_bitwise(tmp_path: Path, model: dict) -> None:
    job = make_job(tmp_path, model=model)
    torch.manual_seed(123)  # the global RNG must not matter
    whole = build_model(job).state_dict()
    union: dict[str, torch.Tensor] = {}
    for k in range(job.training.stages):
        torch.manual_seed(k)
        union.update(build_stage(job, k).state_dict())
    assert union.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, union[name]), name
        assert tensor.dtype == torch.float64


def test_different_seeds_give_different_models(tmp_path: Path) -> None:
    a = build_model(make_job(tmp_path, "a")).state_dict()
    b = build_model(make_job(tmp_path, "b", training={"seed": 1})).state_dict()
    assert not torch.equal(a["layers.1.qkv.weight"], b["layers.1.qkv.weight"])


@pytest.mark.parametrize("model", [{}, LLAMA], ids=["gpt", "llama"])
def test_stages_chained_equal_whole_model(tmp_path: Path, model: dict) -> None:
    job = make_job(tmp_path, model=model)
    inputs, _ = make_data(job).microbatch(0, 0)
    x = inputs
    for k in range(job.training.stages):
        x = build_stage(job, k)(x)
    assert torch.equal(x, build_model(job)(inputs))


def test_a_llama_is_causal(tmp_path: Path) -> None:
    model = build_model(make_job(tmp_path, model=LLAMA))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 64
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9:], b[:, 9:])


def test_grouped_query_attention_is_full_attention_with_shared_key_value_heads(
    tmp_path: Path,
) -> None:
    grouped = build_model(make_job(tmp_path, "g", model=LLAMA))
    full = build_model(make_job(tmp_path, "f", model=LLAMA | {"n_kv_heads": 4}))
    state = grouped.state_dict()
    for i in range(1, 3):  # each key/value head serves two query heads, in order
        for name in ("k", "v"):
            w = state[f"layers.{i}.{name}.weight"].view(2, 8, 32)  # [kv heads, head dim, d]
            state[f"layers.{i}.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(32, 32)
    full.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full(ids), grouped(ids), rtol=0, atol=1e-12)


def test_rope_tables_are_built_once_per_length_and_are_those_computed_afresh(
    tmp_path: Path,
) -> None:
    model = build_model(make_job(tmp_path, model=LLAMA))
    block = model.layers["1"]
    like = torch.zeros(1, dtype=torch.float32)
    cos, sin = block._rope(16, like)
    again = block._rope(16, like)
    assert again[0] is cos and again[1] is sin  # cached, not rebuilt per call
    hd = block.head_dim
    inv = 1.0 / block.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(16, dtype=torch.float64), inv)
    angles = torch.cat((angles, angles), dim=-1)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    shorter = block._rope(9, like)  # another length has its own tables
    assert shorter[0].shape == (9, hd) and torch.equal(shorter[0], cos[:9])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(ids), model(ids))  # the cache changes no result


def test_llama_keys_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads"):
        make_job(tmp_path, model=LLAMA | {"n_kv_heads": 3})
    with pytest.raises(ConfigError, match=r"model\.d_model"):  # head dim 6/2 = 3: odd
        make_job(tmp_path, model=LLAMA | {"d_model": 6, "n_heads": 2})
    assert make_job(tmp_path, model=LLAMA).model.swiglu_hidden == 88  # 8/3 * 32, up to 8s


def test_loss_sum_sums_samples_of_mean_token_loss() -> None:
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (3, 5))
    per_sample = [torch.nn.functional.cross_entropy(logits[i], targets[i]) for i in range(3)]
    assert torch.allclose(loss_sum(logits, targets), sum(per_sample))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["synthetic", "text"])
def test_microbatch_data_is_a_function_of_seed_step_index(tmp_path: Path, kind: str) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    data = {"kind": kind, "path": str(corpus)} if kind == "text" else {"kind": kind}
    job = make_job(tmp_path, model={"vocab_size": 256}, data=data)
    a, b = make_data(job), make_data(job)
    x, y = a.microbatch(3, 1)
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x, b.microbatch(3, 1)[0]) and torch.equal(y, b.microbatch(3, 1)[1])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(x, a.microbatch(3, 2)[0])
    assert not torch.equal(x, a.microbatch(4, 1)[0])
