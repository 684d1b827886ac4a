"""The ordering rules of a replica's state and update streams, one rule at a time: each with a
sequence it admits and one it refuses (the headers alone; no server, no tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from swarm.job.rule import EagerOp
from swarm.rpc.stream_order import OutOfOrder, StateOrder, UpdateHeader, UpdateOrder

SUMS = 2  # gradient sums an update carries (the stage's parameters)
H = UpdateHeader


def _stream(
    headers: Sequence[UpdateHeader], *, from_step: int = 5, rounds: bool = False
) -> list[UpdateHeader]:
    """Each header a whole update (its two sums in one message); the updates begun."""
    order = UpdateOrder(from_step, rounds=rounds, sums=SUMS)
    begun = []
    for header in headers:
        update = order.message(header)
        assert update is not None
        begun.append(update)
        assert [order.sum(str(i)) for i in range(SUMS)] == list(range(SUMS))
    order.end()
    return begun


def _refused(headers: Sequence[UpdateHeader], match: str, **kwargs: bool | int) -> None:
    with pytest.raises(OutOfOrder, match=match):
        _stream(headers, **kwargs)  # type: ignore[arg-type]


# -- where the stream starts, and step order ----------------------------------------------------


def test_the_first_update_is_of_the_step_asked_from_or_later() -> None:
    assert [u.step for u in _stream([H(5, 8)])] == [5]
    assert [u.step for u in _stream([H(7, 8)])] == [7]
    _refused([H(4, 8)], r"update of step 4 out of order")


def test_a_plain_update_is_followed_by_the_next_steps() -> None:
    assert [u.step for u in _stream([H(5, 8), H(6, 8), H(7, 8)])] == [5, 6, 7]
    _refused([H(5, 8), H(5, 8)], r"update of step 5 out of order")  # again
    _refused([H(5, 8), H(7, 8)], r"update of step 7 out of order")  # one skipped


def test_an_empty_stream_is_in_order() -> None:
    assert _stream([]) == []


# -- round ends ---------------------------------------------------------------------------------


def test_a_round_end_comes_before_its_steps_own_update() -> None:
    end = H(6, 8, round_end=True)
    steps = _stream([H(5, 8), end, H(6, 8), H(7, 8)], rounds=True)
    assert [(u.step, u.round_end) for u in steps] == [(5, False), (6, True), (6, False), (7, False)]
    _refused([H(5, 8), end, H(7, 8)], r"update of step 7 out of order", rounds=True)


def test_a_second_round_end_at_one_step_is_refused() -> None:
    end = H(6, 8, round_end=True)
    _refused([H(5, 8), end, end], r"update of step 6 out of order", rounds=True)


def test_without_rounds_a_round_end_is_a_plain_update() -> None:
    (update,) = _stream([H(5, 8, round_end=True, eager=EagerOp.STEP)])
    assert (update.round_end, update.eager) == (False, EagerOp.NONE)
    # So it moves the step on: its step again is out of order.
    _refused([H(5, 8, round_end=True), H(5, 8)], r"update of step 5 out of order")


# -- eager operations ---------------------------------------------------------------------------


def test_a_round_ends_eager_operation_is_step_or_average_or_none() -> None:
    for op in (EagerOp.NONE, EagerOp.STEP):
        (update,) = _stream([H(6, 8, round_end=True, eager=op)], rounds=True)
        assert update.eager is op and update.boundary == -1
    for op in (EagerOp.LAST, EagerOp.MEAN, 9):
        _refused([H(6, 8, round_end=True, eager=op)], rf"eager operation {int(op)} ", rounds=True)


def test_an_average_and_only_an_average_names_the_round_it_ends() -> None:
    (average,) = _stream([H(6, 0, round_end=True, eager=EagerOp.AVERAGE, boundary=4)], rounds=True)
    assert (average.eager, average.boundary) == (EagerOp.AVERAGE, 4)
    for boundary in (0, 7):  # none, or a round not ended yet
        _refused(
            [H(6, 0, round_end=True, eager=EagerOp.AVERAGE, boundary=boundary)],
            rf"eager operation 2 of the round ending at {boundary}",
            rounds=True,
        )
    _refused([H(6, 8, round_end=True, eager=EagerOp.STEP, boundary=4)], r"ending at 4", rounds=True)
    _refused([H(6, 8, boundary=4)], r"eager operation 0 of the round ending at 4", rounds=True)


def test_an_average_may_arrive_anywhere_and_moves_no_step() -> None:
    average = H(6, 0, round_end=True, eager=EagerOp.AVERAGE, boundary=4)
    step = H(6, 8, round_end=True, eager=EagerOp.STEP)
    updates = [H(5, 8), average, step, average, H(6, 8), H(7, 8)]
    assert [u.step for u in _stream(updates, rounds=True)] == [5, 6, 6, 6, 6, 7]
    # An average first: the stream is at its step.
    assert len(_stream([average, H(6, 8)], rounds=True)) == 2
    _refused([average, H(7, 8)], r"update of step 7 out of order", rounds=True)
    # An average after a plain update of step 5 does not move the sender past 6.
    _refused([H(5, 8), average, H(7, 8)], r"update of step 7 out of order", rounds=True)


# -- samples and the clipping coefficient -------------------------------------------------------


def test_an_update_takes_a_sample_unless_the_rule_has_rounds() -> None:
    assert _stream([H(5, 0)], rounds=True)[0].total_samples == 0
    _refused([H(5, 0)], r"an update of 0 samples with coefficient 1.0")
    _refused([H(5, -1)], r"an update of -1 samples", rounds=True)


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5])
def test_the_clipping_coefficient_is_in_0_1(scale: float) -> None:
    assert _stream([H(5, 8, 0.25), H(6, 8, 1.0)])[0].scale == 0.25
    _refused([H(5, 8, scale)], rf"coefficient {scale}")


# -- an update in several messages, and its sums ------------------------------------------------


def test_a_message_continuing_an_update_carries_its_step_samples_and_coefficient() -> None:
    order = UpdateOrder(5, rounds=False, sums=SUMS)
    assert order.message(H(5, 8, 0.5)) is not None and order.sum("0") == 0
    assert order.message(H(5, 8, 0.5)) is None and order.sum("1") == 1  # the same update
    assert order.message(H(6, 8)) is not None  # whole: the next begins
    for other in (H(7, 8), H(6, 9), H(6, 8, 0.5)):
        with pytest.raises(OutOfOrder, match=r"the update of step 6 with 0 of 2 sums"):
            order.message(other)


def test_the_sums_come_numbered_in_order() -> None:
    order = UpdateOrder(5, rounds=False, sums=SUMS)
    order.message(H(5, 8))
    assert order.sum("0") == 0
    for wrong in ("0", "2", "x"):
        with pytest.raises(OutOfOrder, match=rf"gradient sum '{wrong}' where 1 was due"):
            order.sum(wrong)


def test_the_stream_ends_with_its_last_update_whole() -> None:
    order = UpdateOrder(5, rounds=False, sums=SUMS)
    order.message(H(5, 8))
    order.sum("0")
    with pytest.raises(OutOfOrder, match=r"the update of step 5 has 1 of 2 sums"):
        order.end()
    order.sum("1")
    order.end()


# -- a state ------------------------------------------------------------------------------------


def test_a_state_is_of_one_step() -> None:
    order = StateOrder(most=4)
    order.message(3)
    order.message(3)
    assert order.step == 3
    with pytest.raises(OutOfOrder, match=r"a state of step 3, then of step 4"):
        order.message(4)


def test_a_state_names_each_tensor_once() -> None:
    order = StateOrder(most=4)
    order.tensor("param/a", 1)
    order.tensor("param/b", 1)
    assert order.names == {"param/a", "param/b"}
    with pytest.raises(OutOfOrder, match=r"'param/a' twice"):
        order.tensor("param/a", 1)


def test_a_state_holds_at_most_the_stages_tensors() -> None:
    order = StateOrder(most=2)
    order.tensor("a", 1)
    order.tensor("b", 1)
    with pytest.raises(OutOfOrder, match=r"more than the 2 tensors stage 1 has"):
        order.tensor("c", 1)
