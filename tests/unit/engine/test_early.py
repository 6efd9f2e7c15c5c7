"""The early-reduction plan (hvdlite/common/engine/early.py): what the next round starts early,
from the agreed outcome of each round (pure logic)."""
from hvdlite.common.engine.early import EarlyPlan


class Cache:
    """Stands for the response cache: slot -> response object."""

    def __init__(self, slots):
        self.held = {slot: object() for slot in slots}

    def __call__(self, slot):
        return self.held.get(slot)


def starter():
    return lambda entry: (lambda: True)


def never():
    raise AssertionError("start() asked for a slot whose start is known")


def alone(plan, slot, start=None):
    plan.after_round(slot, True, start or starter)


def test_a_tensor_repeated_alone_is_planned_after_its_second_round():
    plan = EarlyPlan(Cache([3]))
    plan.after_round(None, True, never)   # negotiated in full
    alone(plan, 3)                        # alone once: its successor is not known yet
    assert plan.next is None
    plan.after_round(3, True, never)      # alone again: 3 follows 3
    assert plan.next is not None and plan.next[0] == 3
    plan.after_round(3, True, never)      # it came again (early): still planned
    assert plan.next[0] == 3


def test_a_loop_over_several_tensors_is_followed():
    plan = EarlyPlan(Cache(range(4)))
    for slot in range(4):                 # first pass: each learns its start
        alone(plan, slot)
    planned = []
    for slot in range(4):                 # second pass: each predicts its successor
        plan.after_round(slot, True, never)
        planned.append(plan.next[0])
    assert planned == [1, 2, 3, 0]


def test_rounds_that_ran_nothing_keep_the_plan():
    plan = EarlyPlan(Cache([1]))
    alone(plan, 1)
    plan.after_round(None, False, never)   # an idle round between the two
    plan.after_round(1, True, never)
    plan.after_round(None, False, never)
    assert plan.next[0] == 1


def test_other_work_breaks_the_chain_but_not_what_was_learned():
    plan = EarlyPlan(Cache([1, 2]))
    alone(plan, 1)
    alone(plan, 2)
    plan.after_round(None, True, never)   # two tensors, or one negotiated in full
    assert plan.next is None
    plan.after_round(1, True, never)      # 2 followed 1 before: planned again at once
    assert plan.next[0] == 2
    plan.after_round(2, True, never)      # nothing ran alone right after 2 (the break)
    assert plan.next is None


def test_a_wrong_prediction_is_corrected():
    plan = EarlyPlan(Cache([1, 2, 3]))
    for slot in (1, 2, 1):
        alone(plan, slot)
    assert plan.next[0] == 2
    plan.after_round(3, True, starter)    # 3 came instead of 2
    plan.after_round(1, True, never)
    assert plan.next is None or plan.next[0] != 2
    plan.after_round(3, True, never)      # 3 follows 1 now
    plan.after_round(1, True, never)
    assert plan.next[0] == 3


def test_a_tensor_that_cannot_start_early_is_not_planned():
    plan = EarlyPlan(Cache([1]))
    alone(plan, 1, lambda: None)          # too large, another path, a group...
    plan.after_round(1, True, lambda: None)
    assert plan.next is None


def test_a_slot_given_to_another_tensor_is_not_planned_for_the_old_one():
    cache = Cache([1])
    plan = EarlyPlan(cache)
    alone(plan, 1)
    plan.after_round(1, True, never)
    assert plan.next[0] == 1
    cache.held[1] = object()              # erased and reused (a new negotiation)
    plan.after_round(None, True, never)
    fresh = starter()
    plan.after_round(1, True, lambda: fresh)   # asked again: the tensor is new
    assert plan.next == (1, fresh)
    del cache.held[1]
    plan.after_round(1, True, lambda: None)
    assert plan.next is None
