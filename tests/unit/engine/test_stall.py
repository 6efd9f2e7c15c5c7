"""The stall report's description of what the ranks missing a tensor are doing (pure logic)."""
from hvdlite.common.engine.stall import _missing_ranks_doing, _oldest_first


def test_names_each_missing_ranks_pending_tensors_oldest_first():
    waiting_on = {1: ["old", "newer"], 2: []}
    assert _missing_ranks_doing([1, 2], waiting_on) == (
        "rank 1 is waiting on 'old', 'newer'; rank 2 has no operation pending")


def test_lists_three_names_then_counts_the_rest():
    waiting_on = {0: [f"t{i}" for i in range(5)]}
    assert _missing_ranks_doing([0], waiting_on) == (
        "rank 0 is waiting on 't0', 't1', 't2' and 2 more")


def test_a_rank_without_a_report_counts_as_having_nothing_pending():
    assert _missing_ranks_doing([3], {}) == "rank 3 has no operation pending"


def test_pending_tensors_are_listed_oldest_first():
    assert _oldest_first({"b": 1.0, "a": 5.0, "c": 1.0}) == ["a", "b", "c"]
    assert _oldest_first(None) == [] and _oldest_first({}) == []
