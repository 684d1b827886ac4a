"""`swarm local` for `pool.mode = "local"` (DiLoCo-style local steps): R replicas of every stage
simulated in one process, replaying a route record (swarm/model/routes.py) or a synthetic one.
It is the reference the swarm's local mode must match float64-exactly (docs/jobs.md, "Pool
modes"), so every rule here is one the stage servers implement the same way:

- each replica of stage k holds its own copy of the stage's parameters and its own inner
  optimizer (`build_optimizer`); the pool shares the round's start parameters and the outer
  optimizer (`build_outer_optimizer`) with its momentum buffer;
- a step's run goes forward through its chain's replicas and back through the same ones (or,
  where its `back` says so, through another replica that recomputed the stage from the same
  inputs); its parameter gradients are summed into that replica only for the stages it counts
  at;
- what a step's end and a round's end do is the rule's (`local`, `local-eager`, `step-eager`):
  a strategy chosen once from the job's rule (`swarm.model.replay_rounds`, which says each);
  a replica left out of a round's group is gone.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch

from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.job.rule import rule_of
from swarm.model.data import DataSource, make_data, make_val_data
from swarm.model.optim import build_optimizer
from swarm.model.outer_rules import build_outer_optimizer
from swarm.model.reference import evaluate
from swarm.model.replay_rounds import Pool, Replica, replay_round
from swarm.model.routes import Join, Record, Resume, Run, StepRuns, Sync
from swarm.model.transformer import (
    StageModule,
    build_model,
    layer_costs,
    loss_sum,
    partition,
    precision,
)
from swarm.ops.progress import StepRecord

__all__ = [
    "simulates_replicas",
    "synthetic_routes",
    "train_replicas",
]

DEFAULT_REPLICAS = 2


def simulates_replicas(job: JobConfig) -> bool:
    """Whether `swarm local` trains `job` as replicas of every stage (`train_replicas`): local
    steps, or delayed_update's eager rule (the replicas differ); else as one (`train_local`)."""
    return rule_of(job).rounds


def synthetic_routes(job: JobConfig, replicas: int, steps: int | None = None) -> Iterator[Record]:
    """The record `swarm local --replicas R` replays without `--routes`: replicas "r0".."rR-1"
    of every stage join at step 0 from the initial parameters; at each step and stage a seeded
    permutation spreads the microbatches evenly over the replicas (SWARM's stochastic wiring,
    so chains cross replicas), every run counting at every stage; every stage's round ends after
    each step t with (t + 1) % sync_every == 0, and after the last step."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    total = job.training.steps if steps is None else steps
    n_stages, m = job.training.stages, job.training.microbatches_per_step
    names = tuple(f"r{i}" for i in range(replicas))
    for k in range(n_stages):
        for name in names:
            yield Join(0, k, name, None)
    everywhere, rule = tuple(range(n_stages)), rule_of(job)
    for t in range(total):
        held = [_spread(job.training.seed, t, k, m, replicas) for k in range(n_stages)]
        chains = [tuple(names[held[k][i]] for k in range(n_stages)) for i in range(m)]
        yield StepRuns(t, tuple(Run(i, everywhere, chains[i]) for i in range(m)))
        if rule.rounds and rule.is_boundary(t + 1, total):
            for k in range(n_stages):
                yield Sync(t, k, names)


def _spread(seed: int, step: int, stage: int, microbatches: int, replicas: int) -> list[int]:
    """The replica of each microbatch at `stage` in `step`: the permutation's j-th microbatch
    goes to replica j % R, so each replica gets M / R of them (one more for some if uneven)."""
    key = f"swarm-replicas/{seed}/{step}/{stage}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    held = [0] * microbatches
    for j, index in enumerate(torch.randperm(microbatches, generator=gen).tolist()):
        held[index] = j % replicas
    return held


def train_replicas(
    job: JobConfig,
    device: torch.device | str = "cpu",
    *,
    replicas: int | None = None,
    routes: Iterable[Record] | None = None,
    steps: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    eval_every: int | None = None,
) -> StageModule:
    """Train `job` (`pool.mode = "local"`) as its swarm would with the replicas and routes of
    `routes` (a route record), or of `synthetic_routes(job, replicas)` (default 2 replicas).
    Returns the whole model holding the final shared parameters: a round always ends after the
    last step; a record that lacks it (cut short by `steps`) gets one here for every stage, its
    replicas in the order they joined. A record naming a replica that is not there, or out of
    step order, is a `ConfigError` that names the step. `eval_every` (the reference only, for
    benchmarks): evaluate every that many steps whatever the job says; with the eager overlap,
    whose replicas share no parameters, the replicas' mean is evaluated (what the job would
    end with there)."""
    if not simulates_replicas(job):
        raise ConfigError(
            f'the {rule_of(job).kind} rule: replicas with local steps need pool.mode = "local" '
            "(step mode's reference is swarm local without --replicas/--routes, but for "
            'delayed_update with pool.overlap = "eager")'
        )
    if routes is not None and replicas is not None:
        raise ConfigError("give replicas or routes, not both: a route record names its replicas")
    total = job.training.steps if steps is None else steps
    if routes is None:
        routes = synthetic_routes(job, DEFAULT_REPLICAS if replicas is None else replicas, total)
    return _Replay(job, device, on_step, eval_every).run(routes, total)


class _Replay:
    def __init__(
        self,
        job: JobConfig,
        device: torch.device | str,
        on_step: Callable[[StepRecord], None] | None,
        eval_every: int | None = None,
    ) -> None:
        self.job, self.device, self.on_step = job, device, on_step
        self.round = replay_round(job)  # the rule's round end, chosen once
        self.total = job.training.steps
        self.model = build_model(job, device)
        self.data: DataSource = make_data(job)
        self.every = job.training.eval_every if eval_every is None else eval_every
        self.val = make_val_data(job) if self.every else None
        self.pools = []
        for layers in partition(layer_costs(job.model), job.training.stages):
            # A view sharing the model's layers: the start parameters are the model's own.
            shared = StageModule({i: self.model.layers[str(i)] for i in layers})
            start = list(shared.parameters())
            outer = build_outer_optimizer(start, job.pool)
            self.pools.append(Pool(start, outer, copy.deepcopy(shared), {}))
        self.done = 0  # steps whose runs are applied

    def run(self, routes: Iterable[Record], total: int) -> StageModule:
        self.total = total
        for record in routes:
            if record.step >= total:
                break
            if isinstance(record, StepRuns):
                self._step(record)
            elif isinstance(record, Sync):
                self._sync(record)
            elif isinstance(record, Resume):
                self._resume(record)
            else:
                self._join(record)
        if self.done < total:
            raise ConfigError(
                f"the route record holds the runs of {self.done} steps; the job trains {total}"
            )
        for k, pool in enumerate(self.pools):  # the round that always ends after the last step
            if self.round.needs_last_round(pool, total - 1):
                self._sync(Sync(total - 1, k, tuple(pool.replicas)))
        if self.val is not None:  # the final evaluation, of the trained parameters
            began = time.perf_counter()
            val_loss = evaluate(self.job, self.model, self.val, self.device)
            if self.on_step:
                seconds = time.perf_counter() - began
                self.on_step(StepRecord(total, math.nan, 0, seconds, val_loss=val_loss))
        return self.model

    def _pool(self, step: int, stage: int) -> Pool:
        if not 0 <= stage < len(self.pools):
            raise ConfigError(
                f"route record, step {step}: stage {stage} does not exist; the job has stages "
                f"0..{len(self.pools) - 1}"
            )
        return self.pools[stage]

    def _replica(self, step: int, stage: int, peer: str) -> Replica:
        found = self._pool(step, stage).replicas.get(peer)
        if found is None:
            raise ConfigError(
                f"route record, step {step}: peer {peer!r} is not a replica of stage {stage} "
                "(it never joined it, or a round dropped it)"
            )
        return found

    def _expect(self, record: Record, step: int, when: str) -> None:
        if record.step != step:
            raise ConfigError(
                f"route record: a {type(record).__name__.lower()} at step {record.step} after "
                f"step {self.done - 1}'s runs; it must come {when}"
            )

    def _resume(self, record: Resume) -> None:
        """A coordinator restarted at `record.step`: the replicas it names go on with what they
        hold, and only they (one it does not name left while none ran: its round's samples
        dropped, as a round's end drops one missing from its group); one the record never gave
        the stage cannot be replayed."""
        self._expect(record, self.done, f"before step {record.step}'s runs")
        pool = self._pool(record.step, record.stage)
        for peer in record.peers:
            if peer not in pool.replicas:
                raise ConfigError(
                    f"route record, step {record.step}: peer {peer!r} resumes stage "
                    f"{record.stage}, which the record never gave it"
                )
        pool.replicas = {peer: pool.replicas[peer] for peer in record.peers}
        pool.own = {peer: own for peer, own in pool.own.items() if peer in record.peers}

    def _join(self, record: Join) -> None:
        self._expect(record, self.done, f"before step {record.step}'s runs")
        pool = self._pool(record.step, record.stage)
        if record.peer in pool.replicas and record.source is None and self.done == 0:
            return  # a coordinator restarted before step 0 committed: the same initial state
        if record.peer in pool.replicas:
            raise ConfigError(
                f"route record, step {record.step}: peer {record.peer!r} joins stage "
                f"{record.stage}, which it already serves"
            )
        if record.source is None:  # the job's initial parameters, no optimizer state yet
            module = copy.deepcopy(pool.initial)
            pool.replicas[record.peer] = Replica(module, self._inner(module))
            self.round.joined(pool, record.peer, None)
            return
        source = self._replica(record.step, record.stage, record.source)
        module = copy.deepcopy(source.module)
        optimizer = self._inner(module)
        optimizer.load_state_dict(copy.deepcopy(source.optimizer.state_dict()))
        pool.replicas[record.peer] = Replica(module, optimizer)
        self.round.joined(pool, record.peer, record.source)

    def _inner(self, module: StageModule) -> torch.optim.Optimizer:
        return build_optimizer(module.parameters(), self.job.optimizer)

    def _step(self, record: StepRuns) -> None:
        t = record.step
        if t != self.done:
            raise ConfigError(
                f"route record: step {t}'s runs where step {self.done}'s were due (a scheduler "
                "stopped between a step's APPLY and its record leaves that step out)"
            )
        began = time.perf_counter()
        val_loss = None
        if self.val is not None and t % self.every == 0:  # the shared parameters (a round's start)
            self.round.before_evaluation(self.pools)
            val_loss = evaluate(self.job, self.model, self.val, self.device)
        loss_total, loss_samples = 0.0, 0
        touched: dict[int, Replica] = {}
        for run in record.runs:
            counted = self._run(t, run, touched)
            if counted is not None:
                loss_total += counted[0]
                loss_samples += counted[1]
        self.round.step_end(t, touched.values())
        self.done = t + 1
        if self.on_step:
            mean = loss_total / loss_samples if loss_samples else math.nan
            seconds, tokens = time.perf_counter() - began, loss_samples * self.job.model.seq_len
            done = StepRecord(t, mean, loss_samples, seconds, tokens)
            self.on_step(replace(done, val_loss=val_loss))

    def _run(self, t: int, run: Run, touched: dict[int, Replica]) -> tuple[float, int] | None:
        """One run of step `t`: forward through its chain, back through the same replicas with
        the boundaries detached (as between servers); its parameter gradients are summed at the
        stages it counts at. Its (loss sum, samples) when it counts at the last stage."""
        n_stages, m = len(self.pools), self.job.training.microbatches_per_step
        if len(run.chain) != n_stages:
            raise ConfigError(
                f"route record, step {t}: run {run.index} names {len(run.chain)} replicas; the "
                f"job has {n_stages} stages"
            )
        if not 0 <= run.index < m:
            raise ConfigError(
                f"route record, step {t}: microbatch {run.index} does not exist (0..{m - 1})"
            )
        chain = [self._replica(t, k, peer) for k, peer in enumerate(run.chain)]
        counted = set(run.stages)
        for k in counted:
            self._pool(t, k)
        inputs, targets = (x.to(self.device) for x in self.data.microbatch(t, run.index))
        boundaries: list[torch.Tensor] = []  # the input of each stage after the first
        outputs: list[torch.Tensor] = []
        x = inputs
        with precision(self.job, self.device):
            for k, replica in enumerate(chain):
                if k > 0:
                    x = x.detach().requires_grad_(True)
                    boundaries.append(x)
                x = replica.module(x)
                outputs.append(x)
            loss = loss_sum(x, targets)
        outputs[-1] = loss
        n = int(inputs.shape[0])
        grad: torch.Tensor | None = None
        lowest = min(counted, default=n_stages)
        for k in range(n_stages - 1, lowest - 1, -1):  # nothing below the lowest counted stage
            replica, counts = chain[k], k in counted
            leaf, out = (boundaries[k - 1] if k > 0 else None), outputs[k]
            if run.backward_peer(k) != run.chain[k]:
                # The Backward ran on another replica, which recomputed the stage from the
                # same inputs with its own parameters (the one that did the Forward failed).
                replica = self._replica(t, k, run.backward_peer(k))
                x = inputs if leaf is None else leaf.detach().requires_grad_(True)
                leaf = None if k == 0 else x
                with precision(self.job, self.device):
                    out = replica.module(x)
            wanted: list[torch.Tensor] = [leaf] if leaf is not None else []
            if counts:
                wanted += replica.params
            grads = torch.autograd.grad(out, wanted, grad_outputs=grad)
            if k > 0:
                grad, grads = grads[0], grads[1:]
            if counts:
                key = id(replica)
                if replica.sums is None:
                    replica.sums = [g.clone() for g in grads]
                else:
                    for s, g in zip(replica.sums, grads, strict=True):
                        s.add_(g)
                replica.step_samples += n
                touched[key] = replica
        if n_stages - 1 in counted:
            return float(loss.detach()), n
        return None

    def _sync(self, record: Sync) -> None:
        self._expect(record, self.done - 1, f"after step {record.step}'s runs")
        pool = self._pool(record.step, record.stage)
        if len(set(record.group)) != len(record.group):
            raise ConfigError(
                f"route record, step {record.step}: stage {record.stage}'s round names a "
                f"replica twice: {list(record.group)}"
            )
        members = [self._replica(record.step, record.stage, p) for p in record.group]
        self.round.end_round(record, pool, members, last=record.step == self.total - 1)
