"""fusion.plan_batches and FusionBuffer (pure logic, no MPI)."""
import random

import numpy as np
import pytest

from hvdlite.common.engine.fusion import FusionBuffer, plan_batches


def plan(items, threshold):
    """items: list of (key, nbytes); returns batches as lists of item indices."""
    indexed = list(enumerate(items))
    batches = plan_batches(indexed, key=lambda it: it[1][0], nbytes=lambda it: it[1][1],
                           threshold=threshold)
    return [[i for i, _ in batch] for batch in batches]


def check_invariants(items, threshold, batches):
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(items))), "every item exactly once"
    for b in batches:
        assert b, "no empty batch"
        assert b == sorted(b), f"items keep their order inside a batch: {b}"
        keys = {items[i][0] for i in b}
        assert len(keys) == 1, f"one key per batch: {b}"
        if len(b) > 1:
            assert None not in keys, "unfusable items run alone"
            assert threshold > 0, "threshold 0 fuses nothing"
            assert sum(items[i][1] for i in b) <= threshold, f"batch over threshold: {b}"
    firsts = [b[0] for b in batches]
    assert firsts == sorted(firsts), f"batches ordered by first item: {batches}"


def test_fills_up_to_threshold():
    assert plan([("a", 4), ("a", 4), ("a", 4)], 8) == [[0, 1], [2]]


def test_exactly_threshold_fits():
    assert plan([("a", 5), ("a", 3), ("a", 1)], 8) == [[0, 1], [2]]


def test_everything_fits_in_one_batch():
    assert plan([("a", 1)] * 10, 1 << 20) == [list(range(10))]


def test_keys_never_mix_and_batches_ordered_by_first_item():
    items = [("f32", 4), ("f64", 8), ("f32", 4), ("f64", 8), ("i32", 4)]
    assert plan(items, 100) == [[0, 2], [1, 3], [4]]


def test_none_key_runs_alone():
    items = [("a", 1), (None, 1), ("a", 1), (None, 1)]
    assert plan(items, 100) == [[0, 2], [1], [3]]


def test_oversize_item_runs_alone():
    items = [("a", 4), ("a", 100), ("a", 4)]
    batches = plan(items, 10)
    check_invariants(items, 10, batches)
    assert [1] in batches
    assert [0, 2] in batches


def test_threshold_zero_disables_fusion():
    items = [("a", 1), ("a", 1), ("b", 1), ("a", 0)]
    assert plan(items, 0) == [[0], [1], [2], [3]]


def test_zero_byte_items_fuse():
    items = [("a", 0), ("a", 8), ("a", 0)]
    assert plan(items, 8) == [[0, 1, 2]]


def test_empty_input():
    assert plan([], 100) == []


def test_items_are_returned_not_copied():
    objs = [object() for _ in range(3)]
    batches = plan_batches(objs, key=lambda o: 1, nbytes=lambda o: 1, threshold=10)
    assert batches == [objs] and all(a is b for a, b in zip(batches[0], objs))


@pytest.mark.parametrize("seed", range(30))
def test_random_plans_keep_invariants_and_are_deterministic(seed):
    rng = random.Random(seed)
    threshold = rng.choice([0, 1, 16, 64, 1000])
    items = [(rng.choice(["a", "b", "c", None]), rng.choice([0, 1, 4, 8, 40, 2000]))
             for _ in range(rng.randrange(0, 60))]
    batches = plan(items, threshold)
    check_invariants(items, threshold, batches)
    assert plan(items, threshold) == batches, "same input, same plan (every rank agrees)"
    if threshold > 0:
        # fusion actually happens: two consecutive same-key items that fit go together
        for i in range(len(items) - 1):
            (k1, s1), (k2, s2) = items[i], items[i + 1]
            if k1 is not None and k1 == k2 and s1 + s2 <= threshold and all(
                    items[j][0] != k1 for j in range(i)):
                assert any(i in b and i + 1 in b for b in batches), (items, batches)


# --- FusionBuffer --------------------------------------------------------------------------------
def test_fusion_buffer_view_dtype_and_size():
    buf = FusionBuffer()
    v = buf.view(40, np.dtype(np.float32))
    assert v.dtype == np.float32 and v.shape == (10,)
    v[:] = np.arange(10)
    w = buf.view(80, np.dtype(np.float64))
    assert w.dtype == np.float64 and w.shape == (10,)


def test_fusion_buffer_reused_and_never_shrinks():
    buf = FusionBuffer()
    big = buf.view(1024, np.dtype(np.uint8))
    small = buf.view(16, np.dtype(np.int32))
    assert small.shape == (4,)
    assert np.shares_memory(big, small), "a smaller request reuses the buffer"
    again = buf.view(1024, np.dtype(np.uint8))
    assert np.shares_memory(big, again)
    bigger = buf.view(4096, np.dtype(np.uint8))
    assert bigger.shape == (4096,)


def test_fusion_buffer_zero_bytes():
    assert FusionBuffer().view(0, np.dtype(np.float32)).shape == (0,)


def test_what_fuses_with_what_in_a_round():
    """Execution's fusion keys: small allreduces fuse by dtype/op/scale; small host allgathers
    and reducescatters fuse each with their own kind (by their result's bytes for an
    allgather); GPU allgathers and large ones run alone."""
    from hvdlite.common.engine.execution import FUSE_BELOW_BYTES, fusion_key
    from hvdlite.common.engine.handle import Entry, Handle
    from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, REDUCESCATTER, Request,
                                                Response)

    def item(kind, rows=4, dtype="float32", device=-1, first_dims=(), op=0):
        array = np.zeros((rows, 2), dtype=dtype)
        response = Response("t", kind, dtype, array.shape, op, device=device,
                            first_dims=first_dims)
        return response, Entry(Request("t", kind, dtype, array.shape), array, None, None,
                               Handle("t", lambda: True))

    gather = fusion_key(item(ALLGATHER, first_dims=(4, 1)))
    assert gather is not None
    assert fusion_key(item(ALLGATHER, rows=1, first_dims=(1, 9))) == gather
    assert fusion_key(item(ALLGATHER, dtype="int32", first_dims=(4, 1))) != gather
    assert fusion_key(item(ALLGATHER, device=0, first_dims=(4, 1))) is None
    rows = FUSE_BELOW_BYTES // 8   # float32 rows of 2: this rank's input is small, the result is not
    assert fusion_key(item(ALLGATHER, first_dims=(4, rows))) is None
    scatter = fusion_key(item(REDUCESCATTER))
    assert scatter is not None and scatter != gather
    assert fusion_key(item(REDUCESCATTER, op=1)) != scatter
    assert fusion_key(item(ALLREDUCE)) not in (None, gather, scatter)
