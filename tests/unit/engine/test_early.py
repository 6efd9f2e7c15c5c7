"""The early-reduction plan (hvdlite/common/engine/early.py): what the next round starts early,
from the agreed outcome of each round (pure logic)."""
from hvdlite.common.engine.early import EarlyPlan


def starter():
    return lambda entry: (lambda: True)


def never():
    raise AssertionError("start() asked although the slot had not run alone twice")


def test_a_slot_that_ran_alone_twice_in_a_row_is_planned():
    plan = EarlyPlan()
    plan.after_round(None, True, never)   # negotiated in full
    plan.after_round(3, True, never)      # alone once: not yet
    assert plan.next is None
    start = starter()
    plan.after_round(3, True, lambda: start)
    assert plan.next == (3, start)
    plan.after_round(3, True, never)      # it came again (early): the plan stays
    assert plan.next == (3, start)


def test_rounds_that_ran_nothing_keep_the_plan():
    plan = EarlyPlan()
    start = starter()
    plan.after_round(1, True, never)
    plan.after_round(None, False, never)   # an idle round between the two
    plan.after_round(1, True, lambda: start)
    plan.after_round(None, False, never)
    assert plan.next == (1, start)


def test_anything_else_running_drops_the_plan():
    plan = EarlyPlan()
    plan.after_round(1, True, never)
    plan.after_round(1, True, starter)
    assert plan.next is not None
    plan.after_round(None, True, never)   # two tensors, or a new one negotiated in full
    assert plan.next is None
    plan.after_round(1, True, never)      # alone once again: not yet
    assert plan.next is None


def test_another_slot_alone_starts_over():
    plan = EarlyPlan()
    plan.after_round(1, True, never)
    plan.after_round(1, True, starter)
    plan.after_round(2, True, never)
    assert plan.next is None
    start = starter()
    plan.after_round(2, True, lambda: start)
    assert plan.next == (2, start)


def test_a_tensor_that_cannot_start_early_is_not_planned():
    plan = EarlyPlan()
    plan.after_round(1, True, never)
    plan.after_round(1, True, lambda: None)   # too large, another path, a group...
    assert plan.next is None
    plan.after_round(1, True, lambda: None)
    assert plan.next is None
