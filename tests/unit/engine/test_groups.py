"""A grouped operation negotiated as one request: its validation across ranks (allreduce,
allgather whose members' first dimensions differ, reducescatter), the members' completion
(GroupSink), a joined rank's stand-in, and the reuse of a named group's entries (GroupTemplate).
Pure logic, no MPI; the multi-rank behaviour is in tests/core/workers/core_collectives_worker.py
(grouped_allreduce.*, grouped_allgather.*, grouped_reducescatter.*)."""
import numpy as np
import pytest

from hvdlite.common.api.submission import GroupTemplate
from hvdlite.common.engine.handle import Entry, GroupSink, Handle
from hvdlite.common.engine.join import stand_in
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ERROR_FAILED_ON_RANK,
                                            ERROR_MISMATCH, FAILED, REDUCESCATTER, Request,
                                            build_response)
from hvdlite.common.reduce_ops import ReduceOp

LAYOUT = (("g.0", "float32", (3,), -1), ("g.1", "int64", (2, 2), -1), ("g.2", "float32", (), -1))


def packed(layout=LAYOUT, op=ReduceOp.Sum, pre=1.0, post=1.0, name="g.group3", kind=ALLREDUCE):
    return Request(name, kind, "", (), int(op), -1, -1, pre, post, layout=layout)


def gather_layout(rows: tuple[int, int], row=(2,)):
    """A grouped allgather's layout on a rank contributing ``rows`` rows to each member."""
    return (("ag.0", "int32", (rows[0],) + row, -1), ("ag.1", "float64", (rows[1], 3), -1))


def with_member(i, **change):
    """LAYOUT with member ``i``'s field(s) replaced."""
    fields = dict(zip(("name", "dtype", "shape", "device"), LAYOUT[i]))
    fields.update(change)
    return LAYOUT[:i] + (tuple(fields.values()),) + LAYOUT[i + 1:]


# --- validation ----------------------------------------------------------------------------------
def test_agreeing_layouts_give_one_response_per_member():
    resp = build_response({0: packed(pre=0.5, post=2.0), 1: packed(pre=0.5, post=2.0)})
    assert resp.error is None and resp.name == "g.group3"
    assert [m.name for m in resp.members] == ["g.0", "g.1", "g.2"]
    assert [(m.dtype, m.shape, m.device) for m in resp.members] == [
        ("float32", (3,), -1), ("int64", (2, 2), -1), ("float32", (), -1)]
    for member in resp.members:
        assert (member.kind, member.reduce_op, member.prescale, member.postscale) == (
            ALLREDUCE, int(ReduceOp.Sum), 0.5, 2.0)
        assert member.members == () and member.error is None


def test_members_inherit_cacheability():
    a, b = packed(), packed()._replace(cacheable=False)
    resp = build_response({0: a, 1: b})
    assert not resp.cacheable and not any(m.cacheable for m in resp.members)


@pytest.mark.parametrize("member,change,fragments", [
    (1, dict(shape=(4,)), ["'g.1'", "shape", "(2, 2)", "(4,)"]),
    (2, dict(dtype="float64"), ["'g.2'", "dtype", "float32", "float64"]),
    (0, dict(device=0), ["'g.0'", "device", "cpu", "gpu"]),
])
def test_a_member_that_differs_is_named_with_the_ranks(member, change, fragments):
    odd = with_member(member, **change)
    resp = build_response({0: packed(), 1: packed(), 2: packed(odd)})
    assert resp.error_kind == ERROR_MISMATCH and resp.members == ()
    msg = resp.error
    assert "grouped allreduce 'g.group3'" in msg
    assert f"tensor {member} of 3" in msg
    assert "ranks [2]" in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in: {msg}"


def test_the_first_differing_member_is_named():
    odd = with_member(2, shape=(9,))
    odd = odd[:1] + (("g.1", "int64", (7,), -1),) + odd[2:]
    msg = build_response({0: packed(), 1: packed(odd)}).error
    assert "'g.1'" in msg and "'g.2'" not in msg, msg


def test_group_sizes_that_differ_are_reported():
    msg = build_response({0: packed(), 1: packed(LAYOUT[:2])}).error
    assert "number of tensors" in msg and "3 on ranks [0]" in msg and "2 on ranks [1]" in msg


def test_op_and_scale_factors_checked_for_the_whole_group():
    assert "reduce op" in build_response({0: packed(), 1: packed(op=ReduceOp.Max)}).error
    assert "prescale" in build_response({0: packed(), 1: packed(pre=0.5)}).error


def test_a_rank_that_failed_before_submitting_fails_the_group():
    failed = Request("g.group3", FAILED, "uint8", (), failure="ValueError: bad input")
    resp = build_response({0: packed(), 1: failed})
    assert resp.error_kind == ERROR_FAILED_ON_RANK
    assert "ranks [1]" in resp.error and "bad input" in resp.error


def test_the_layout_is_part_of_the_signature():
    assert packed().signature() != packed(with_member(1, shape=(4,))).signature()
    assert packed().signature() == packed(name="other").signature()



def test_a_grouped_allgather_gives_each_member_every_ranks_rows():
    """Members' first dimensions may differ across ranks (as for single allgathers): each
    member's response carries the rows of every rank, in rank order."""
    resp = build_response({0: packed(gather_layout((2, 0)), kind=ALLGATHER, op=-1),
                           1: packed(gather_layout((1, 4)), kind=ALLGATHER, op=-1),
                           2: packed(gather_layout((0, 1)), kind=ALLGATHER, op=-1)})
    assert resp.error is None and resp.kind == ALLGATHER
    assert [(m.name, m.kind, m.first_dims) for m in resp.members] == [
        ("ag.0", ALLGATHER, (2, 1, 0)), ("ag.1", ALLGATHER, (0, 4, 1))]


@pytest.mark.parametrize("odd_row, field", [((3,), "shape after the first dimension"),
                                            ((2, 1), "number of dimensions")])
def test_a_grouped_allgather_member_with_other_rows_fails_the_group(odd_row, field):
    resp = build_response({0: packed(gather_layout((2, 1)), kind=ALLGATHER, op=-1),
                           1: packed(gather_layout((2, 1), odd_row), kind=ALLGATHER, op=-1)})
    assert resp.error_kind == ERROR_MISMATCH
    assert "grouped allgather 'g.group3' failed because of its member 'ag.0'" in resp.error
    assert field in resp.error and "[1]" in resp.error


def test_a_grouped_reducescatter_checks_whole_shapes():
    layout = (("rs.0", "float32", (4, 2), -1), ("rs.1", "int32", (3,), -1))
    ok = build_response({r: packed(layout, kind=REDUCESCATTER) for r in range(3)})
    assert ok.error is None and [m.shape for m in ok.members] == [(4, 2), (3,)]
    assert all(m.kind == REDUCESCATTER and m.first_dims == () for m in ok.members)
    odd = (layout[0], ("rs.1", "int32", (5,), -1))
    bad = build_response({0: packed(layout, kind=REDUCESCATTER),
                          1: packed(odd, kind=REDUCESCATTER)})
    assert "grouped reducescatter 'g.group3' failed because of its member 'rs.1'" in bad.error
    assert "shape" in bad.error


def test_groups_of_different_kinds_under_one_name_are_a_mismatch():
    resp = build_response({0: packed(), 1: packed(kind=REDUCESCATTER)})
    assert resp.error_kind == ERROR_MISMATCH and "operation" in resp.error

# --- completion ----------------------------------------------------------------------------------
def recorder():
    calls = []
    return calls, lambda error, readies: calls.append((error, list(readies)))


def test_sink_finishes_once_every_member_reported():
    calls, finish = recorder()
    sink = GroupSink("g", 3, finish)
    sink._complete(object())
    sink.completed(1)
    assert calls == []
    sink._complete(object())
    assert calls == [(None, [])]
    sink._complete(object())   # (a late duplicate report changes nothing)
    assert len(calls) == 1


def test_sink_counts_a_batch_of_members_at_once():
    calls, finish = recorder()
    sink = GroupSink("g", 5, finish)
    sink.completed(4)
    assert calls == []
    sink.completed(1)
    assert calls == [(None, [])]


def test_sink_keeps_the_first_error_and_waits_for_every_member():
    calls, finish = recorder()
    sink = GroupSink("g", 3, finish)
    first, second = ValueError("first"), ValueError("second")
    sink._complete(None, first)
    sink._complete(None, second)
    assert calls == []
    sink._complete(object())
    assert calls == [(first, [])]


def test_sink_collects_every_batchs_device_readiness_once():
    """The engine sets a batch's readiness callback on each of its members: every batch's
    callback is kept, each once (a 200-member batch must not wait on its event 200 times)."""
    calls, finish = recorder()
    sink = GroupSink("g", 5, finish)
    ready_a, ready_b = (lambda: None), (lambda: None)
    for _ in range(3):   # the first batch's three members
        sink._device_ready = ready_a
    sink._device_ready = None
    for _ in range(2):   # the second batch's two members
        sink._device_ready = ready_b
    sink.completed(5)
    assert calls == [(None, [ready_a, ready_b])]


def test_group_handle_yields_its_list():
    from hvdlite.common.engine.handle import GroupHandle
    handle = Handle("g", lambda: True)
    group = GroupHandle("g", handle).then(lambda results: results + ["post"])
    assert not group.poll() and group.handles == [handle]
    handle._complete(["a", "b"])
    assert group.poll()
    assert group.wait() == ["a", "b", "post"]
    empty = GroupHandle("e", None)
    assert empty.poll() and empty.handles == [] and empty.wait() == []


# --- a joined rank's contribution ----------------------------------------------------------------
def test_stand_in_for_a_group_stands_in_for_each_member():
    resp = build_response({0: packed(op=ReduceOp.Min), 1: packed(op=ReduceOp.Min)})
    entry = stand_in(resp)
    assert entry.stand_in and entry.members is not None and len(entry.members) == 3
    for member, expected in zip(entry.members, resp.members):
        assert member.stand_in and member.name == expected.name
        assert member.array.shape == expected.shape
        assert member.array is member.output
    assert np.all(entry.members[0].array == np.inf)   # Min's identity
    assert np.all(entry.members[1].array == np.iinfo(np.int64).max)


# --- reusing a named group's entries -------------------------------------------------------------
def member_entries(arrays, outputs):
    return [Entry(Request(f"g.{i}", ALLREDUCE, str(a.dtype), a.shape), a,
                  a if outputs is not None else np.empty_like(a), None, None)
            for i, a in enumerate(arrays)]


def arrays_like():
    return [np.ones(3, np.float32), np.zeros((2, 2), np.int64)]


@pytest.mark.parametrize("in_place", [True, False])
def test_template_refills_the_same_entries_with_new_arrays(in_place):
    first = arrays_like()
    entries = member_entries(first, first if in_place else None)
    template = GroupTemplate("g", entries, packed(), in_place, ReduceOp.Sum, 1.0, 1.0)
    new = arrays_like()
    outputs = new if in_place else None
    old_outputs = [e.output for e in entries]
    again = template.refill(new, outputs, ReduceOp.Sum, 1.0, 1.0)
    assert again is entries
    for entry, array, old in zip(entries, new, old_outputs):
        assert entry.array is array
        if in_place:
            assert entry.output is array
        else:   # a new result every time: the last step's results belong to the caller
            assert entry.output is not old and entry.output is not array
            assert entry.output.shape == array.shape and entry.output.dtype == array.dtype


@pytest.mark.parametrize("change", ["shape", "dtype", "count", "op", "prescale", "postscale",
                                    "mode", "noncontiguous", "readonly", "not_numpy",
                                    "other_output"])
def test_template_refuses_anything_different(change):
    first = arrays_like()
    template = GroupTemplate("g", member_entries(first, first), packed(), True, ReduceOp.Sum,
                             1.0, 1.0)
    arrays = arrays_like()
    outputs, op, pre, post = arrays, ReduceOp.Sum, 1.0, 1.0
    if change == "shape":
        arrays[0] = np.ones(4, np.float32)
    elif change == "dtype":
        arrays[1] = np.zeros((2, 2), np.int32)
    elif change == "count":
        arrays = arrays[:1]
    elif change == "op":
        op = ReduceOp.Max
    elif change == "prescale":
        pre = 0.5
    elif change == "postscale":
        post = 2.0
    elif change == "mode":
        outputs = None
    elif change == "noncontiguous":
        arrays[1] = np.zeros((2, 4), np.int64)[:, ::2]
    elif change == "readonly":
        arrays[0].flags.writeable = False
    elif change == "not_numpy":
        arrays[0] = [1.0, 1.0, 1.0]
    elif change == "other_output":
        outputs = [arrays[0], np.zeros((2, 2), np.int64)]
    if outputs is not None and change != "other_output":
        outputs = arrays
    assert template.refill(arrays, outputs, op, pre, post) is None
