"""response_cache.ResponseCache (pure logic, no MPI)."""
import pytest

from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ERROR_MISMATCH, Request,
                                            build_response)
from hvdlite.common.engine.handle import Entry
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.engine.response_cache import ResponseCache


def req(name, shape=(3,), dtype="float32", op=ReduceOp.Sum, cacheable=True):
    return Request(name, ALLREDUCE, dtype, shape, int(op), cacheable=cacheable)


def negotiated(request):
    return build_response({0: request, 1: request})


def lookup(cache, request):
    """(slot announced, slot found stale) for one new entry of ``request``, through
    ResponseCache.match, which the controller runs on every round's new entries."""
    entry = Entry(request, None, None, None, None)
    stale = cache.match([entry])
    assert len(stale) <= 1
    return entry.slot, next(iter(stale), None)


def put(cache, request):
    return cache.put(negotiated(request), request)


def test_empty_cache():
    cache = ResponseCache(8)
    assert len(cache) == 0 and cache.num_words == 0
    assert lookup(cache, req("a")) == (None, None)


def test_hit_returns_slot_and_response():
    cache = ResponseCache(8)
    a = req("a")
    slot = put(cache, a)
    assert slot == 0
    assert lookup(cache, a) == (0, None)
    assert cache.response(0) == negotiated(a)
    assert len(cache) == 1


def test_hit_for_an_equal_request_object():
    cache = ResponseCache(8)
    put(cache, req("a", shape=(2, 2)))
    assert lookup(cache, req("a", shape=(2, 2))) == (0, None)


@pytest.mark.parametrize("change", [dict(shape=(4,)), dict(dtype="float64"),
                                    dict(op=ReduceOp.Max)])
def test_stale_signature_reports_slot_to_invalidate(change):
    cache = ResponseCache(8)
    put(cache, req("b"))
    put(cache, req("a"))
    assert lookup(cache, req("a", **change)) == (None, 1)
    assert lookup(cache, req("b")) == (0, None)


def test_other_name_misses():
    cache = ResponseCache(8)
    put(cache, req("a"))
    assert lookup(cache, req("z")) == (None, None)


def test_error_and_uncacheable_responses_not_stored():
    cache = ResponseCache(8)
    bad = build_response({0: req("e", shape=(1,)), 1: req("e", shape=(2,))})
    assert bad.error_kind == ERROR_MISMATCH
    assert cache.put(bad, req("e", shape=(1,))) is None
    auto = req("auto", cacheable=False)
    assert cache.put(negotiated(auto), auto) is None
    assert len(cache) == 0 and lookup(cache, req("e", shape=(1,))) == (None, None)


def test_capacity_zero_disables():
    cache = ResponseCache(0)
    assert put(cache, req("a")) is None
    assert len(cache) == 0 and cache.num_words == 0
    assert lookup(cache, req("a")) == (None, None)


def test_capacity_full_no_eviction():
    cache = ResponseCache(2)
    assert put(cache, req("a")) == 0
    assert put(cache, req("b")) == 1
    assert put(cache, req("c")) is None
    assert len(cache) == 2
    assert lookup(cache, req("c")) == (None, None)
    assert lookup(cache, req("a")) == (0, None) and lookup(cache, req("b")) == (1, None)


def test_erase_then_reuse_lowest_free_slot():
    cache = ResponseCache(8)
    for i, name in enumerate("abcd"):
        assert put(cache, req(name)) == i
    cache.erase(2)
    cache.erase(0)
    assert len(cache) == 2
    assert lookup(cache, req("a")) == (None, None) and lookup(cache, req("c")) == (None, None)
    assert put(cache, req("x")) == 0
    assert put(cache, req("y")) == 2
    assert put(cache, req("z")) == 4
    assert lookup(cache, req("y")) == (2, None)
    assert cache.response(2).name == "y"


def test_erase_twice_is_harmless():
    cache = ResponseCache(4)
    put(cache, req("a"))
    put(cache, req("b"))
    cache.erase(0)
    cache.erase(0)
    assert len(cache) == 1
    assert put(cache, req("c")) == 0
    assert put(cache, req("d")) == 2


def test_full_cache_accepts_again_after_erase():
    cache = ResponseCache(2)
    put(cache, req("a"))
    put(cache, req("b"))
    cache.erase(1)
    assert put(cache, req("c")) == 1
    assert put(cache, req("d")) is None


def test_reput_same_name_replaces_entry():
    cache = ResponseCache(8)
    put(cache, req("a", shape=(3,)))
    put(cache, req("b"))
    slot = put(cache, req("a", shape=(5,)))
    assert slot == 0, "the old entry's slot is freed first and is the lowest"
    assert len(cache) == 2
    assert lookup(cache, req("a", shape=(5,))) == (0, None)
    assert lookup(cache, req("a", shape=(3,))) == (None, 0)
    assert cache.response(0).shape == (5,)


def test_signature_is_the_own_request_not_the_response():
    """allgather responses carry rank 0's shape; each rank must match against its own."""
    mine = Request("g", ALLGATHER, "int32", (5, 2))
    response = build_response({0: Request("g", ALLGATHER, "int32", (1, 2)), 1: mine})
    cache = ResponseCache(4)
    slot = cache.put(response, mine)
    assert lookup(cache, mine) == (slot, None)
    assert lookup(cache, Request("g", ALLGATHER, "int32", (1, 2))) == (None, slot)


@pytest.mark.parametrize("n,words", [(1, 1), (63, 1), (64, 1), (65, 2), (128, 2), (129, 3)])
def test_num_words(n, words):
    cache = ResponseCache(1000)
    for i in range(n):
        assert put(cache, req(f"t{i}")) == i
    assert cache.num_words == words


def test_num_words_same_for_same_history():
    """Ranks apply identical puts/erases, so they agree on the bit-vector length."""
    def history():
        cache = ResponseCache(100)
        for i in range(70):
            put(cache, req(f"t{i}"))
        for s in (69, 3, 68):
            cache.erase(s)
        put(cache, req("new"))
        return cache.num_words, len(cache)
    assert history() == history()
    words, n = history()
    assert n == 68 and words >= 2   # slot 67 is still in use


def test_held_is_the_slot_s_response_or_none():
    cache = ResponseCache(4)
    assert cache.held(0) is None and cache.held(7) is None   # never used
    slot = put(cache, req("a"))
    assert cache.held(slot) is cache.response(slot)
    cache.erase(slot)
    assert cache.held(slot) is None


def test_match_takes_a_whole_round_and_never_marks_a_join_stale():
    """One call per round: hits get their slots, stale names are collected once, and a join
    (never cached) sharing a cached tensor's name leaves that tensor's slot alone."""
    from hvdlite.common.engine.messages import JOIN
    cache = ResponseCache(8)
    put(cache, req("a"))
    put(cache, req("b"))
    entries = [Entry(r, None, None, None, None)
               for r in (req("a"), req("b", shape=(9,)), req("new"),
                         Request("a", JOIN, "uint8", (), cacheable=False))]
    assert cache.match(entries) == {1}
    assert [e.slot for e in entries] == [0, None, None, None]
