"""build_response: cross-rank validation of one tensor's requests (pure logic, no MPI)."""
import pytest

from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, BARRIER, BROADCAST,
                                            ERROR_MISMATCH, Request, Response, build_response)
from hvdlite.common.reduce_ops import ReduceOp


def ar(name="t", dtype="float32", shape=(3,), op=ReduceOp.Sum, pre=1.0, post=1.0, device=-1,
       cacheable=True):
    return Request(name, ALLREDUCE, dtype, shape, int(op), -1, device, pre, post,
                   cacheable=cacheable)


def bc(name="t", dtype="float32", shape=(3,), root=0):
    return Request(name, BROADCAST, dtype, shape, -1, root)


def ag(name="t", dtype="float32", shape=(3,)):
    return Request(name, ALLGATHER, dtype, shape)


def per_rank(*reqs):
    return dict(enumerate(reqs))


def assert_mismatch(resp: Response, name: str, *fragments: str) -> str:
    assert resp.error is not None, f"expected a mismatch, got {resp}"
    assert resp.error_kind == ERROR_MISMATCH
    assert resp.name == name
    msg = resp.error
    assert repr(name) in msg or name in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in: {msg}"
    return msg


# --- agreement -----------------------------------------------------------------------------------
def test_allreduce_agreement_copies_fields():
    req = ar("grad.w", "float64", (2, 5), ReduceOp.Average, 0.5, 2.0)
    resp = build_response(per_rank(req, req, req))
    assert resp.error is None and resp.error_kind is None
    assert (resp.name, resp.kind, resp.dtype, resp.shape) == ("grad.w", ALLREDUCE, "float64",
                                                              (2, 5))
    assert resp.reduce_op == ReduceOp.Average
    assert (resp.prescale, resp.postscale, resp.device) == (0.5, 2.0, -1)
    assert resp.first_dims == ()
    assert resp.cacheable


def test_broadcast_agreement():
    resp = build_response(per_rank(bc(root=2), bc(root=2), bc(root=2)))
    assert resp.error is None and resp.kind == BROADCAST and resp.root == 2
    assert resp.shape == (3,)


def test_barrier_agreement():
    req = Request("barrier", BARRIER, "uint8", ())
    resp = build_response(per_rank(req, req))
    assert resp.error is None and resp.kind == BARRIER


def test_single_rank():
    resp = build_response({0: ar(shape=(4,))})
    assert resp.error is None and resp.shape == (4,)


def test_cacheable_only_if_every_rank_says_so():
    assert build_response(per_rank(ar(), ar())).cacheable
    assert not build_response(per_rank(ar(), ar(cacheable=False))).cacheable
    assert not build_response(per_rank(ar(cacheable=False), ar())).cacheable


# --- allgather first dims ------------------------------------------------------------------------
def test_allgather_first_dims_in_rank_order():
    reqs = {2: ag(shape=(5, 3)), 0: ag(shape=(2, 3)), 1: ag(shape=(0, 3))}  # any dict order
    resp = build_response(reqs)
    assert resp.error is None
    assert resp.first_dims == (2, 0, 5)


def test_allgather_scalar_counts_as_one_row():
    resp = build_response(per_rank(ag(shape=()), ag(shape=())))
    assert resp.error is None and resp.first_dims == (1, 1)


def test_allgather_all_zero_rows():
    resp = build_response(per_rank(ag(shape=(0, 4)), ag(shape=(0, 4)), ag(shape=(0, 4))))
    assert resp.error is None and resp.first_dims == (0, 0, 0)


def test_allgather_trailing_shape_mismatch():
    msg = assert_mismatch(build_response(per_rank(ag(shape=(2, 3)), ag(shape=(2, 4)))), "t",
                          "(3,)", "(4,)", "[0]", "[1]")
    assert "allgather" in msg


def test_allgather_ndim_mismatch():
    assert_mismatch(build_response(per_rank(ag(shape=(2, 3)), ag(shape=(2, 3, 1)),
                                            ag(shape=(1, 3)))),
                    "t", "[0, 2]", "[1]")


def test_allgather_dtype_mismatch():
    assert_mismatch(build_response(per_rank(ag(dtype="int32"), ag(dtype="int64"))), "t",
                    "int32", "int64")


# --- every allreduce field ----------------------------------------------------------------------
@pytest.mark.parametrize("field,kwargs_odd,fragments", [
    ("dtype", dict(dtype="float64"), ["dtype", "float32", "float64"]),
    ("shape", dict(shape=(4,)), ["shape", "(3,)", "(4,)"]),
    ("shape_same_size", dict(shape=(3, 1)), ["shape", "(3,)", "(3, 1)"]),
    ("reduce op", dict(op=ReduceOp.Max), ["Sum", "Max"]),
    ("prescale", dict(pre=2.0), ["prescale", "1.0", "2.0"]),
    ("postscale", dict(post=0.25), ["postscale", "1.0", "0.25"]),
    ("device", dict(device=0), ["device", "'cpu'", "'gpu'"]),
])
@pytest.mark.parametrize("odd", [0, 1, 2])
def test_allreduce_field_mismatch(field, kwargs_odd, fragments, odd):
    reqs = {r: (ar("layer.w", **kwargs_odd) if r == odd else ar("layer.w")) for r in range(3)}
    msg = assert_mismatch(build_response(reqs), "layer.w", *fragments)
    others = [r for r in range(3) if r != odd]
    assert str([odd]) in msg and str(others) in msg, msg


def test_different_gpus_per_rank_agree():
    """One GPU per rank: rank 0 on cuda:0 and rank 1 on cuda:1 is the normal layout."""
    response = build_response(per_rank(ar(device=0), ar(device=1), ar(device=3)))
    assert response.error is None and response.device >= 0


def test_reduce_op_reported_by_name_not_number():
    msg = assert_mismatch(build_response(per_rank(ar(op=ReduceOp.Product),
                                                  ar(op=ReduceOp.Min))), "t")
    assert "Product" in msg and "Min" in msg


def test_disagreeing_ranks_listed():
    reqs = per_rank(ar(shape=(3,)), ar(shape=(3,)), ar(shape=(4,)), ar(shape=(5,)))
    msg = assert_mismatch(build_response(reqs), "t", "(3,)", "(4,)", "(5,)", "[0, 1]", "[2]",
                          "[3]")
    assert "[2, 3]" in msg, f"the disagreeing ranks are not listed together: {msg}"


# --- broadcast -----------------------------------------------------------------------------------
def test_broadcast_root_mismatch():
    msg = assert_mismatch(build_response(per_rank(bc(root=0), bc(root=1), bc(root=0))), "t",
                          "[0, 2]", "[1]")
    assert "root" in msg.lower()


def test_broadcast_shape_mismatch():
    assert_mismatch(build_response(per_rank(bc(shape=(2, 2)), bc(shape=(4,)))), "t",
                    "(2, 2)", "(4,)")


def test_broadcast_dtype_mismatch():
    assert_mismatch(build_response(per_rank(bc(dtype="uint8"), bc(dtype="int8"))), "t",
                    "uint8", "int8")


# --- operation kind ------------------------------------------------------------------------------
def test_operation_kind_mismatch():
    resp = build_response(per_rank(ar("x"), bc("x"), ar("x")))
    msg = assert_mismatch(resp, "x", "allreduce", "broadcast", "[0, 2]", "[1]")
    assert "operation" in msg.lower()


def test_operation_kind_mismatch_allgather():
    assert_mismatch(build_response(per_rank(ag("x"), ag("x"), ar("x"))), "x", "allgather",
                    "allreduce", "[2]")


def test_kind_checked_before_other_fields():
    resp = build_response(per_rank(ar("x", dtype="int8", shape=(1,)), bc("x", dtype="float32")))
    assert_mismatch(resp, "x", "allreduce", "broadcast")


# --- request signatures (what the response cache compares) ---------------------------------------
def test_signature_ignores_name_and_cacheable():
    a = ar("a", cacheable=True)
    b = ar("b", cacheable=False)
    assert a.signature() == b.signature()


@pytest.mark.parametrize("change", [dict(dtype="int32"), dict(shape=(4,)), dict(op=ReduceOp.Max),
                                    dict(pre=0.5), dict(post=3.0), dict(device=1)])
def test_signature_sees_every_field(change):
    assert ar().signature() != ar(**change).signature()


def test_signature_sees_kind_and_root():
    assert bc(root=0).signature() != bc(root=1).signature()
    assert ag().signature() != bc().signature()
