"""hvd.elastic's commits in torchrun's store (issue 48): framing, world numbers, and the
driver's answers from a real torch TCPStore served in this process."""
import datetime

import numpy as np
import pytest

from hvdlite.common.runtime import elastic_wire as wire
from hvdlite.common.runtime.store_commits import (WORLD_STRIDE, StoreChannel, join_frames,
                                                  split_frames, world_number)

torch_distributed = pytest.importorskip("torch.distributed")


@pytest.fixture
def store():
    served = torch_distributed.TCPStore("127.0.0.1", 0, None, True,
                                        datetime.timedelta(seconds=10), wait_for_workers=False)
    yield torch_distributed.PrefixStore("hvdlite/elastic/run", served)


def test_frames_round_trip():
    frames = [b"", b"abc", bytes(range(256)) * 3, memoryview(np.arange(5, dtype=np.int64))]
    got = split_frames(join_frames(frames))
    assert [bytes(f) for f in got] == [bytes(memoryview(f).cast("B")) for f in frames]
    assert split_frames(join_frames([])) == []


def test_world_numbers_grow_across_restarts_and_formations():
    assert world_number(0, 0) == 0
    assert world_number(0, 3) < world_number(1, 0) < world_number(1, 1)
    assert world_number(2, 0) == 2 * WORLD_STRIDE


def test_fetch_have_and_newest_wins(store):
    first = StoreChannel(store, "commits", world_number(0, 0), 0)
    assert first.request(("fetch", 0)) == ("none",)
    assert first.request(("have", 0, (0, 1))) == ("send",)
    tree = {"epoch": 3, "weights": np.arange(6.0)}
    first.send_commit(0, (0, 3), wire.pack(tree))
    assert first.stored(0) == (0, 3) and first.wait_stored(0, (0, 3), 1.0)
    assert first.request(("have", 0, (0, 2))) == ("ok",)     # older than the stored one
    assert first.request(("have", 0, (0, 4))) == ("send",)
    first.send_commit(0, (0, 1), wire.pack({"epoch": 1}))   # an older offer does not win
    assert first.stored(0) == (0, 3)
    # the next world (a restart), another process
    later = StoreChannel(store, "commits", world_number(1, 0), 0)
    kind, key, commit_id, frames = later.request(("fetch", 0))
    assert (kind, key, commit_id) == ("commit", 0, (0, 3))
    got = wire.unpack(frames)
    assert got["epoch"] == 3 and np.array_equal(got["weights"], np.arange(6.0))
    assert later.request(("fetch", 1)) == ("none",)          # states are kept apart
    assert later.request(("outcome", "done", "", [])) == ("ok",)
