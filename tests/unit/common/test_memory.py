"""memory.aligned_empty and memory.BufferPool: alignment, reuse only after the last user of a
block is gone, the idle cap, thread safety (pure logic, one process)."""
import gc
import threading

import numpy as np
import pytest

from hvdlite.common import memory
from hvdlite.common.api import submission
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.memory import (ALIGN_MIN_BYTES, ALIGNMENT, BufferPool, aligned_empty,
                                   fresh_block, result_empty, size_class)

SHAPES = [(), (0,), (1,), (3, 5), (7, 0, 2), (1000, 333), (2**20 + 3,), (64 * 1024,)]
DTYPES = ["bool", "uint8", "int16", "float16", "bfloat16", "int32", "float32", "int64",
          "float64"]


def _np_dtype(name):
    return dtype_info(name).np_dtype


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [aligned_empty, result_empty,
                                  lambda s, d: BufferPool(min_bytes=0).empty(s, d)],
                         ids=["aligned_empty", "result_empty", "pool"])
def test_shape_dtype_alignment(make, shape, dtype):
    a = make(shape, _np_dtype(dtype))
    assert a.shape == shape and a.dtype == _np_dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    # (an empty array has no data to align; result_empty aligns from ALIGN_MIN_BYTES on)
    if a.size and (make is not result_empty or a.nbytes >= ALIGN_MIN_BYTES):
        assert a.ctypes.data % ALIGNMENT == 0
    a[...] = 1   # the whole extent is usable
    assert (a == 1).all()


def test_default_allocator_of_the_core_aligns_from_64_kib():
    """Results of ALIGN_MIN_BYTES or more are aligned (TensorFlow then adopts them without a
    copy); smaller ones are plain np.empty (numpy's 16 bytes), which is cheaper to make."""
    for n in (1, 5, 4099, ALIGN_MIN_BYTES // 4 - 1, ALIGN_MIN_BYTES // 4, 300_000):
        out = submission._default_allocate((n,), np.dtype(np.float32))
        assert out.shape == (n,) and out.dtype == np.float32 and out.flags.c_contiguous
        if out.nbytes >= ALIGN_MIN_BYTES:
            assert out.ctypes.data % ALIGNMENT == 0, n


def _addr(a):
    return a.__array_interface__["data"][0]


def test_block_reused_once_the_last_view_is_gone():
    pool = BufferPool(min_bytes=1024)
    a = pool.empty((4096,), np.float32)
    first = _addr(a)
    view = a[100:200].reshape(10, 10).T   # a derived view keeps the block leased
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    b = pool.empty((4096,), np.float32)
    assert _addr(b) != first, "a block was handed out while a view of it was alive"
    view[...] = 7
    b[...] = 3
    assert (view == 7).all(), "two live arrays share memory"
    del view
    gc.collect()
    assert pool.idle_bytes == 4096 * 4
    c = pool.empty((64, 64), np.float32)   # same byte size, another shape: reused
    assert _addr(c) == first
    assert pool.hits == 1 and pool.misses == 2


def test_framework_tensor_keeps_the_block_leased():
    torch = pytest.importorskip("torch")
    pool = BufferPool(min_bytes=1024)
    a = pool.empty((1 << 12,), np.float32)
    t = torch.from_numpy(a)
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    t.fill_(2.0)
    del t
    gc.collect()
    assert pool.idle_bytes == (1 << 12) * 4


def test_size_classes():
    """Eight classes per power of two: never smaller than asked, at most 12.5% larger, and
    every class is its own class."""
    assert [size_class(n) for n in (0, 1, 7, 15, 16, 17, 18)] == [0, 1, 7, 15, 16, 18, 18]
    assert size_class(4096) == 4096 and size_class(4097) == 4608 and size_class(8000) == 8192
    assert size_class(16 << 20) == 16 << 20 and size_class((16 << 20) + 1) == 18 << 20
    rng = np.random.default_rng(0)
    for n in [*range(1, 5000), *rng.integers(5000, 1 << 40, 20000).tolist()]:
        c = size_class(n)
        assert n <= c <= n + n // 8, (n, c)
        assert size_class(c) == c, n
    classes = {size_class(n) for n in range(1 << 20, (1 << 21) + 1)}
    assert classes == {(8 + k) << 17 for k in range(9)}, sorted(classes)


def test_sizes_of_one_class_share_blocks():
    """An allgather whose result grows or shrinks a little every step (a sparse gradient)
    reuses the block of the previous step; another class gets another block."""
    pool = BufferPool(min_bytes=1024)
    a = pool.empty((1000,), np.float64)     # 8000 bytes: class 8192
    first = _addr(a)
    del a
    gc.collect()
    b = pool.empty((1020,), np.float64)     # 8160 bytes: the same class
    assert _addr(b) == first and b.size == 1020 and pool.hits == 1
    b[...] = 5                               # the whole extent is usable
    del b
    gc.collect()
    c = pool.empty((1030,), np.float64)     # 8240 bytes: class 9216
    assert _addr(c) != first and pool.hits == 1 and pool.misses == 2
    assert pool.idle_bytes == 8192


def test_small_results_are_not_pooled():
    pool = BufferPool(min_bytes=1 << 20)
    a = pool.empty((10,), np.float32)
    del a
    gc.collect()
    assert pool.idle_bytes == 0 and pool.hits == pool.misses == 0


def test_idle_cap_drops_extra_blocks():
    pool = BufferPool(min_bytes=1024, max_idle_bytes=3 * 8192)
    arrays = [pool.empty((2048,), np.float32) for _ in range(5)]   # 8 KiB each
    del arrays
    gc.collect()
    assert pool.idle_bytes == 3 * 8192


def test_zero_cap_turns_pooling_off():
    pool = BufferPool(min_bytes=1024, max_idle_bytes=0)
    a = pool.empty((4096,), np.float32)
    assert a.ctypes.data % ALIGNMENT == 0
    del a
    gc.collect()
    assert pool.idle_bytes == 0 and pool.hits == pool.misses == 0


def test_clear_releases_idle_blocks():
    pool = BufferPool(min_bytes=1024)
    a = pool.empty((4096,), np.float32)
    del a
    gc.collect()
    assert pool.idle_bytes > 0
    pool.clear()
    assert pool.idle_bytes == 0
    pool.empty((4096,), np.float32)
    assert pool.hits == 0


def test_threads_never_share_a_live_block():
    pool = BufferPool(min_bytes=1024)
    errors = []

    def work(seed):
        try:
            for i in range(300):
                a = pool.empty((512,), np.int64)
                a[...] = seed * 1000 + i
                b = pool.empty((512,), np.int64)
                b[...] = -1
                if not (a == seed * 1000 + i).all():
                    errors.append(f"thread {seed}: block shared while leased")
                del a, b
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    gc.collect()
    assert pool.hits > 0
    assert pool.idle_bytes == (pool.misses) * 512 * 8


@pytest.mark.skipif(memory._POPULATE_FLAGS is None, reason="no MAP_POPULATE on this platform")
def test_new_pool_blocks_are_populated_mappings():
    """A pool miss maps its block with the pages populated (page-aligned, zero-filled memory
    from mmap) instead of taking malloc's memory and faulting every page in on first write."""
    block = fresh_block(3 * 4096 + 5)
    assert block.size == 3 * 4096 + 5 and block.dtype == np.uint8 and block.flags.writeable
    assert block.ctypes.data % 4096 == 0 and not block.any()
    block[...] = 7
    pool = BufferPool(min_bytes=1024)
    a = pool.empty((300_000,), np.float32)
    assert a.ctypes.data % 4096 == 0, "the pool did not map its new block"
    a[...] = 1.0
    assert (a == 1.0).all()
