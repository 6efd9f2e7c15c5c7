"""hvdlite.torch.buckets: bucket planning, packing and unpacking, and the errors that name a
bucket's parameters (pure logic, no MPI)."""
import random

import pytest
import torch

from hvdlite.common.errors import RankExitedError, TensorMismatchError
from hvdlite.torch.buckets import (GradientBucket, bucketable_compression, in_bucket, plan,
                                   wire_dtype)
from hvdlite.torch.compression import Compression, Compressor


def check_plan(items, cap, buckets):
    seen = [i for b in buckets for i in b]
    assert len(seen) == len(set(seen)), "an item in two buckets"
    for b in buckets:
        assert len(b) >= 2, f"a bucket of one: {b}"
        assert b == sorted(b), f"items keep their order: {b}"
        assert len({items[i][0] for i in b}) == 1, f"one key per bucket: {b}"
        assert sum(items[i][1] for i in b) <= cap, f"over the cap: {b}"
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets)
    for i, (_, nbytes) in enumerate(items):
        if nbytes >= cap:
            assert i not in seen, f"item {i} of {nbytes} bytes >= cap {cap} was bucketed"


def test_plan_fills_buckets_greedily_in_order():
    items = [("f", 400)] * 7
    assert plan(items, 1000) == [[0, 1], [2, 3], [4, 5]]   # the 7th would be alone
    assert plan(items, 1200) == [[0, 1, 2], [3, 4, 5]]


def test_plan_leaves_large_items_alone_and_keeps_keys_apart():
    items = [("f32", 100), ("f64", 100), ("f32", 5000), ("f32", 100), ("f64", 100)]
    assert plan(items, 1000) == [[0, 3], [1, 4]]


def test_plan_with_cap_zero_or_one_item_makes_no_bucket():
    assert plan([("f", 1), ("f", 1)], 0) == []
    assert plan([("f", 1)], 100) == []
    assert plan([], 100) == []


@pytest.mark.parametrize("seed", range(20))
def test_plan_invariants_on_random_items(seed):
    rng = random.Random(seed)
    items = [(rng.choice("abc"), rng.choice([0, 4, 100, 700, 3000])) for _ in range(60)]
    cap = rng.choice([1, 500, 1000, 4096])
    check_plan(items, cap, plan(items, cap))


def test_wire_dtype_follows_the_compression():
    assert wire_dtype(Compression.none, torch.float32) == torch.float32
    assert wire_dtype(Compression.fp16, torch.float32) == torch.float16
    assert wire_dtype(Compression.bf16, torch.float64) == torch.bfloat16
    assert wire_dtype(Compression.fp16, torch.int64) == torch.int64   # casts floats only

    class Custom(Compressor):
        pass

    assert all(bucketable_compression(c) for c in (Compression.none, Compression.fp16,
                                                    Compression.bf16))
    assert not bucketable_compression(Custom)


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]


def test_pack_and_unpack_round_trip_through_the_flat_tensor():
    ps = params((2, 3), (), (4,))
    for k, p in enumerate(ps):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 10 * k
    bucket = GradientBucket("b", ps, ["a", "b", "c"], torch.float32)
    assert bucket.pack() is bucket.flat
    expected = torch.cat([p.grad.reshape(-1) for p in ps])
    assert torch.equal(bucket.flat, expected)
    bucket.flat.mul_(2)   # as a reduction would
    bucket.unpack()
    for k, p in enumerate(ps):
        assert torch.equal(p.grad, 2 * (torch.arange(p.numel()).reshape(p.shape) + 10 * k))


def test_pack_gives_zeros_to_a_member_without_gradient_and_densifies_sparse_ones():
    ps = params((3,), (2, 2))
    ps[1].grad = torch.sparse_coo_tensor([[0], [1]], [5.0], (2, 2), check_invariants=True)
    bucket = GradientBucket("b", ps, ["a", "b"], torch.float32)
    bucket.flat.fill_(7)
    assert bucket.pack() is bucket.flat
    assert torch.equal(ps[0].grad, torch.zeros(3))
    assert not ps[1].grad.is_sparse
    assert bucket.flat.tolist() == [0, 0, 0, 0, 5, 0, 0]


def test_pack_sends_a_gradient_that_changed_shape_as_is_instead_of_broadcasting_it():
    """A member whose shape changed since the plan: its gradient is not broadcast into its old
    view; the bucket goes as a (1, n) tensor of the gradients as they are (which can never
    match another rank's planned, one-dimensional flat tensor), and unpacks from it."""
    ps = params((4,), (2,))
    bucket = GradientBucket("b", ps, ["a", "b"], torch.float32)
    ps[0].data = torch.zeros(1)
    ps[0].grad, ps[1].grad = torch.full((1,), 3.0), torch.tensor([4.0, 5.0])
    wire = bucket.pack()
    assert wire is bucket.reshaped and wire.shape == (1, 3) and wire.tolist() == [[3, 4, 5]]
    assert bucket.flat.shape == (6,), "the planned flat tensor changed"
    assert "'a' is (1,) instead of (4,)" in bucket.describe_reshaped()
    wire.mul_(2)   # as a reduction would
    bucket.unpack()
    assert ps[0].grad.tolist() == [6.0] and ps[1].grad.tolist() == [8.0, 10.0]
    assert bucket.layout != GradientBucket.signature(ps), "a re-plan would reuse the bucket"


def test_pack_sends_a_same_size_reshape_in_two_dimensions_too():
    """Same number of elements, other shape: still never the planned flat tensor's shape."""
    ps = params((2, 3), (2,))
    bucket = GradientBucket("b", ps, ["a", "b"], torch.float32)
    ps[0].data = torch.zeros(3, 2)
    ps[0].grad, ps[1].grad = torch.ones(3, 2), torch.ones(2)
    wire = bucket.pack()
    assert wire.shape == (1, 8) and wire.shape != bucket.flat.shape
    assert bucket.describe_reshaped() == "; on this rank 'a' is (3, 2) instead of (2, 3)"


def test_pack_casts_to_the_wire_dtype_and_unpack_casts_back():
    ps = params((3,), (2,))
    for p in ps:
        p.grad = torch.full(p.shape, 1.0 / 3)
    bucket = GradientBucket("b", ps, ["a", "b"], torch.float16)
    assert bucket.pack() is bucket.flat and bucket.flat.dtype == torch.float16
    bucket.unpack()
    assert ps[0].grad.dtype == torch.float32
    assert torch.equal(ps[0].grad, torch.tensor(1.0 / 3).half().float().expand(3))


def test_describe_names_the_parameters():
    bucket = GradientBucket("allreduce.l5.bias+5", params(*[(1,)] * 6),
                            [f"l{k}" for k in range(6)], torch.float32)
    text = bucket.describe()
    assert "'allreduce.l5.bias+5'" in text and "'l0', 'l1', 'l2', 'l3' and 2 more" in text


def test_errors_of_a_bucket_keep_their_type_and_name_its_parameters():
    bucket = GradientBucket("allreduce.w+1", params((1,), (1,)), ["w", "b"], torch.float32)
    for cls in (TensorMismatchError, RankExitedError):
        cause = cls("shape [3] on ranks [0], [4] on ranks [1]")
        exc = in_bucket(cause, bucket)
        assert type(exc) is cls and exc.__cause__ is cause
        assert "'w', 'b'" in str(exc) and "shape [3]" in str(exc) and "same model" in str(exc)


def test_errors_without_a_message_constructor_get_a_note():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    bucket = GradientBucket("allreduce.w+1", params((1,), (1,)), ["w", "b"], torch.float32)
    cause = Odd(1, 2)
    exc = in_bucket(cause, bucket)
    assert exc is cause and any("'w', 'b'" in note for note in exc.__notes__)


def test_large_host_gradients_stay_alone_and_gpu_ones_join_up_to_the_cap():
    """On the host a gradient the engine reduces in place (FUSE_BELOW_BYTES or more) would only
    gain two copies in a bucket; on a GPU every gradient under the cap joins one."""
    from hvdlite.common.engine.execution import FUSE_BELOW_BYTES
    from hvdlite.torch.buckets import alone_from
    cap = 25 * 2**20
    assert alone_from(torch.device("cpu"), cap) == FUSE_BELOW_BYTES
    assert alone_from(torch.device("cpu"), 1000) == 1000
    assert alone_from(torch.device("cuda", 1), cap) == cap
