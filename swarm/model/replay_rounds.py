"""How the reference (`swarm.model.local_steps`) ends a stage's round: one strategy per training
rule with rounds, chosen once from the job's rule (`replay_round`), so the replay never tests
the rule itself. The replicas (`stage_server.replica.local_round`) end their rounds by the same
rules with the same functions (`swarm.model.outer_rules`), so both get the same bits.

- `AverageRound` (`local`): after each step every replica that counted samples applies its
  inner optimizer; a round averages its group's pseudo-gradients (`pseudo_gradient`), takes the
  outer step on the pool's start parameters, and every member continues from them.
- `EagerRound` (`local-eager`): a round's average is not waited for: each member takes its outer
  step at once with its own fresh share and the others' shares one round late
  (`eager_gradients`: the previous round's average plus its own share minus its own previous
  share; the Eager Updates rule, arXiv 2502.12996), on a start and an outer optimizer of its own
  (the members differ by their shares); the last round is completed synchronously (the others'
  last shares are added) and the trained model is the members' mean.
- `StepEagerRound` (`step-eager`, delayed_update's eager rule): the eager round of one step with
  the job's optimizer for the outer one: after every step each replica applies its optimizer at
  once to the previous step's average plus its own fresh share (its gradient sum / the step's
  samples at its stage) minus its own previous share; its optimizer state is its own, so the
  replicas drift apart by their shares; the last step is completed and the model is their mean.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.errors import ConfigError
from swarm.job.config import JobConfig
from swarm.job.rule import RuleKind, rule_of
from swarm.model.optim import update
from swarm.model.outer_rules import (
    build_outer_optimizer,
    eager_gradients,
    ordered_sum,
    pseudo_gradient,
)
from swarm.model.routes import Sync
from swarm.model.transformer import StageModule

__all__ = [
    "AverageRound",
    "EagerRound",
    "Own",
    "Pool",
    "ReplayRound",
    "Replica",
    "StepEagerRound",
    "replay_round",
]


@dataclass
class Replica:
    module: StageModule
    optimizer: torch.optim.Optimizer
    sums: list[torch.Tensor] | None = None  # the current step's gradient sum
    step_samples: int = 0
    round_samples: int = 0  # counted since its round began (its join or the last sync)

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())


@dataclass
class Own:
    """An eager rule's member: its own round start, outer optimizer and last share
    (`StepEagerRound`'s: its parameters, and no outer optimizer: its inner one's)."""

    start: list[torch.Tensor]
    outer: torch.optim.Optimizer | None
    share: list[torch.Tensor] | None = None


@dataclass
class Pool:
    """One stage: its replicas (in the order they joined), the round's start parameters (the
    returned model's own) with their outer optimizer, and the job's initial parameters; under
    an eager rule, each member's own start (`own`) and the last round's average."""

    start: list[nn.Parameter]
    outer: torch.optim.Optimizer
    initial: StageModule
    replicas: dict[str, Replica]
    own: dict[str, Own] = field(default_factory=dict)
    average: list[torch.Tensor] | None = None
    last_shares: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # eager, by member
    ended: int = -1  # the step the last round ended after


def _holds(replica: Replica, params: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(replica.params, params, strict=True))


class ReplayRound:
    """What a rule with rounds does at a replica's join, a step's end and a round's end; the
    hooks a rule need not take do nothing."""

    def __init__(self, job: JobConfig) -> None:
        self.job = job

    def joined(self, pool: Pool, peer: str, source: str | None) -> None:
        """`peer` has just joined `pool` (a copy of `source`'s replica, or fresh)."""

    def step_end(self, t: int, touched: Iterable[Replica]) -> None:
        """Every replica that counted samples in step `t` applies its optimizer to its own mean
        gradient (local steps); the others apply nothing."""
        for replica in touched:
            assert replica.sums is not None
            n = replica.step_samples
            for p, s in zip(replica.params, replica.sums, strict=True):
                p.grad = s.div_(n)
            update(replica.optimizer, self.job, t)
            replica.sums, replica.step_samples = None, 0
            replica.round_samples += n

    def before_evaluation(self, pools: Sequence[Pool]) -> None:
        """Make the model (every pool's start) what an evaluation during training sees."""

    def needs_last_round(self, pool: Pool, last: int) -> bool:
        """Whether `pool` still needs the round that always ends after step `last`."""
        raise NotImplementedError

    def end_round(self, record: Sync, pool: Pool, members: list[Replica], last: bool) -> None:
        """Stage `record.stage`'s round after step `record.step` (`last`: the job's last)."""
        raise NotImplementedError


class AverageRound(ReplayRound):
    """`local`: the group's averaged pseudo-gradient, one outer step on the pool's start."""

    def needs_last_round(self, pool: Pool, last: int) -> bool:
        return any(not _holds(r, pool.start) for r in pool.replicas.values())

    def end_round(self, record: Sync, pool: Pool, members: list[Replica], last: bool) -> None:
        averaged = pseudo_gradient(pool.start, [(m.params, m.round_samples) for m in members])
        if averaged is not None:
            for p, g in zip(pool.start, averaged, strict=True):
                p.grad = g
            pool.outer.step()
            pool.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for member in members:
                for p, s in zip(member.params, pool.start, strict=True):
                    p.copy_(s)
                member.round_samples = 0
        # Replicas left out of the round are gone, and their round's samples with them.
        pool.replicas = {p: pool.replicas[p] for p in record.group}


class EagerRound(ReplayRound):
    """`local-eager` (`eager_gradients`): each member's outer step on its own start; the last
    round completes the average, and the pool's start becomes the members' mean."""

    def __init__(self, job: JobConfig) -> None:
        if job.training.eval_every:
            raise ConfigError(
                'pool.overlap = "eager" with training.eval_every: the replicas share no '
                "parameters between rounds to evaluate; set eval_every = 0 (the final model is "
                "evaluated)"
            )
        super().__init__(job)

    def joined(self, pool: Pool, peer: str, source: str | None) -> None:
        """Its own start, outer momentum and last share: the source's, or fresh."""
        module = pool.replicas[peer].module
        if source is None:
            pool.own[peer] = self._own(module, None, None)
            return
        own = pool.own[source]
        share = None if own.share is None else [t.clone() for t in own.share]
        pool.own[peer] = self._own(module, own, share)

    def _own(
        self, module: StageModule, source: Own | None, share: list[torch.Tensor] | None
    ) -> Own:
        if source is None:
            start = [p.detach().clone() for p in module.parameters()]
            return Own(start, build_outer_optimizer(start, self.job.pool))
        assert source.outer is not None
        start = [s.detach().clone() for s in source.start]
        outer = build_outer_optimizer(start, self.job.pool)
        outer.load_state_dict(copy.deepcopy(source.outer.state_dict()))
        return Own(start, outer, share)

    def before_evaluation(self, pools: Sequence[Pool]) -> None:
        """No parameters are shared: the model (every pool's start) becomes the mean of each
        pool's replicas."""
        for pool in pools:
            replicas = list(pool.replicas.values())
            summed = ordered_sum([r.params for r in replicas])
            with torch.no_grad():
                for p, t in zip(pool.start, summed, strict=True):
                    p.copy_(t.div_(len(replicas)))

    def needs_last_round(self, pool: Pool, last: int) -> bool:
        return pool.ended != last

    def end_round(self, record: Sync, pool: Pool, members: list[Replica], last: bool) -> None:
        owns = [pool.own[p] for p in record.group]
        total = sum(m.round_samples for m in members)
        if record.averaged is not None:  # some member's share did not reach the last average
            missing = [p for p in record.averaged if p not in pool.last_shares]
            if missing:
                raise ConfigError(
                    f"route record, step {record.step}: stage {record.stage}'s last average is "
                    f"of {missing}, who took no part in the round before"
                )
            parts = [pool.last_shares[p] for p in record.averaged]
            pool.average = ordered_sum(parts) if parts else None
        if total:
            shares = [self._share(o, m, total) for o, m in zip(owns, members, strict=True)]
            grads = eager_gradients(pool.average, shares, [o.share for o in owns], complete=last)
            for own, member, share, g in zip(owns, members, shares, grads, strict=True):
                self._outer_step(own, member, g, record.step)
                own.share = share
            pool.average = ordered_sum(shares)
            pool.last_shares = dict(zip(record.group, shares, strict=True))
        with torch.no_grad():
            for own, member in zip(owns, members, strict=True):
                self._restart(own, member)
                member.round_samples, member.sums = 0, None
            if last:  # the trained model: the members' mean (they differ by their shares)
                meaned = record.group if record.mean is None else record.mean
                if not set(meaned) <= set(record.group) or not meaned:
                    raise ConfigError(
                        f"route record, step {record.step}: stage {record.stage}'s mean is of "
                        f"{list(meaned)}, not members of its round {list(record.group)}"
                    )
                starts = ordered_sum([pool.own[p].start for p in meaned])
                for p, t in zip(pool.start, starts, strict=True):
                    p.copy_(t.div_(len(meaned)))
        pool.replicas = {p: pool.replicas[p] for p in record.group}
        pool.own = {p: pool.own[p] for p in record.group}
        pool.ended = record.step

    def _share(self, own: Own, member: Replica, total: int) -> list[torch.Tensor]:
        """A member's fresh share of its round: (start - parameters) x its samples / `total`."""
        with torch.no_grad():
            ratio = member.round_samples / total
            return [(s - p) * ratio for s, p in zip(own.start, member.params, strict=True)]

    def _outer_step(self, own: Own, member: Replica, grad: list[torch.Tensor], t: int) -> None:
        """A member's outer step with its eager gradient `grad` after step `t`: on its own start
        with its outer optimizer."""
        assert own.outer is not None
        for s, g in zip(own.start, grad, strict=True):
            s.grad = g
        own.outer.step()
        own.outer.zero_grad(set_to_none=True)

    def _restart(self, own: Own, member: Replica) -> None:
        """The member continues from its own start (under `torch.no_grad`)."""
        for p, s in zip(member.params, own.start, strict=True):
            p.copy_(s)


class StepEagerRound(EagerRound):
    """`step-eager`: rounds of one step; the share is the step's gradient, the outer step the
    job's optimizer on the member's own parameters."""

    def _own(
        self, module: StageModule, source: Own | None, share: list[torch.Tensor] | None
    ) -> Own:
        return Own(list(module.parameters()), None, share)

    def step_end(self, t: int, touched: Iterable[Replica]) -> None:
        """Nothing applied yet: the round's end after this step does (`end_round`)."""
        for replica in touched:
            replica.round_samples += replica.step_samples
            replica.step_samples = 0

    def _share(self, own: Own, member: Replica, total: int) -> list[torch.Tensor]:
        """Its gradient sums of the step / `total` (zeros when it took none)."""
        with torch.no_grad():
            if member.sums is None:
                return [torch.zeros_like(p) for p in member.params]
            return [s / total for s in member.sums]

    def _outer_step(self, own: Own, member: Replica, grad: list[torch.Tensor], t: int) -> None:
        """The job's optimizer on its parameters."""
        for p, g in zip(member.params, grad, strict=True):
            p.grad = g
        update(member.optimizer, self.job, t)

    def _restart(self, own: Own, member: Replica) -> None:
        """Its parameters are its start: nothing to restore."""


_ROUNDS: dict[RuleKind, type[ReplayRound]] = {
    RuleKind.LOCAL: AverageRound,
    RuleKind.LOCAL_EAGER: EagerRound,
    RuleKind.STEP_EAGER: StepEagerRound,
}


def replay_round(job: JobConfig) -> ReplayRound:
    """The round strategy of `job`'s rule; a `ConfigError` for a rule without rounds."""
    kind = rule_of(job).kind
    if kind not in _ROUNDS:
        raise ConfigError(f"the {kind} rule has no rounds to replay")
    return _ROUNDS[kind](job)
