"""Who exchanges what across hosts in the hierarchical allreduce and allgather
(hvdlite/common/data_paths/hier_plan.py): pure logic, expectations written down by hand."""
import pytest

from hvdlite.common.data_paths.hier_plan import (MIN_PIECE_BYTES, PIECES_PER_SEGMENT,
                                               SMALL_BYTES, GatherGroup, Hosts, Segment,
                                               cross_pieces, gather_groups, my_segments,
                                               reduce_segments, share_bounds)

F32 = 4
N = 100_000   # float32 elements: 400 KB, split into shares


def test_hosts_from_each_rank_s_view():
    # every rank reports the ranks on its host; hosts ordered by their lowest rank
    per_rank = [[2, 0], [1, 3], [0, 2], [3, 1]]
    hosts = Hosts.from_ranks_by_host(per_rank)
    assert hosts.members == ((0, 2), (1, 3))
    assert hosts.local_sizes == [2, 2] and hosts.count == 2
    assert hosts.locate(3) == (1, 1) and hosts.locate(0) == (0, 0)
    with pytest.raises(ValueError, match="rank 5"):
        hosts.locate(5)


def test_share_bounds_are_the_window_s_cache_line_aligned_split():
    # 1000 float32 over 2 ranks: the middle, 500, rounded down to a 16-element cache line
    assert share_bounds(1000, F32, 2) == [0, 496, 1000]
    assert share_bounds(1000, F32, 1) == [0, 1000]
    assert share_bounds(N, F32, 2) == [0, 50000, N]
    # 33333 and 66666 rounded down to multiples of 16
    assert share_bounds(N, F32, 3) == [0, 33328, 66656, N]


def test_homogeneous_hosts_exchange_between_equal_local_ranks():
    hosts = Hosts(((0, 1), (2, 3)))
    assert reduce_segments(hosts, N, F32) == [Segment(0, 50000, (0, 2)),
                                              Segment(50000, N, (1, 3))]


def test_three_plus_one_the_lone_rank_carries_a_third_to_each_peer():
    hosts = Hosts(((0, 1, 2), (3,)))
    assert reduce_segments(hosts, N, F32) == [Segment(0, 33328, (0, 3)),
                                              Segment(33328, 66656, (1, 3)),
                                              Segment(66656, N, (2, 3))]


def test_one_two_one_the_single_rank_hosts_take_part_in_both_halves():
    hosts = Hosts(((0,), (1, 2), (3,)))
    assert reduce_segments(hosts, N, F32) == [Segment(0, 50000, (0, 1, 3)),
                                              Segment(50000, N, (0, 2, 3))]


def test_two_plus_three_halves_and_thirds_cut_into_four_segments():
    hosts = Hosts(((0, 1), (2, 3, 4)))
    assert reduce_segments(hosts, N, F32) == [Segment(0, 33328, (0, 2)),
                                              Segment(33328, 50000, (0, 3)),
                                              Segment(50000, 66656, (1, 3)),
                                              Segment(66656, N, (1, 4))]


def test_round_robin_placement_uses_the_set_s_ranks():
    hosts = Hosts(((0, 2), (1, 3)))
    assert [s.group for s in reduce_segments(hosts, N, F32)] == [(0, 1), (2, 3)]


def test_small_and_empty_buffers_are_shares_too():
    # the hierarchical path leaves batches under SMALL_BYTES to MPI (it never asks for them);
    # the plan itself has no special case for them
    assert SMALL_BYTES == 64 * 1024
    hosts = Hosts(((0, 1), (2, 3, 4)))
    assert [s.group for s in reduce_segments(hosts, 1000, F32)] == [(0, 2), (0, 3), (1, 3),
                                                                     (1, 4)]
    assert reduce_segments(hosts, 0, F32) == []


def test_a_segment_crosses_in_pieces_of_an_eighth_none_under_the_minimum():
    big = Segment(100, 100 + (32 << 20) // F32, (0, 2))     # 32 MiB: eight 4 MiB pieces
    small = Segment(big.hi, big.hi + (1 << 20) // F32 + 5, (1, 3))   # 1 MiB + 5 elements
    cut = cross_pieces([big, small], F32)
    assert PIECES_PER_SEGMENT == 8 and MIN_PIECE_BYTES == 1 << 20
    assert [(p.hi - p.lo) * F32 for p in cut[:8]] == [4 << 20] * 8
    assert all(p.group == (0, 2) for p in cut[:8])
    # under 8 MiB a segment is cut at 1 MiB; the last piece takes the remainder
    assert [(p.lo, p.hi, p.group) for p in cut[8:]] == [
        (small.lo, small.lo + (1 << 20) // F32, (1, 3)), (small.lo + (1 << 20) // F32,
                                                          small.hi, (1, 3))]
    assert cross_pieces([Segment(0, 3, (0, 1))], 8) == [Segment(0, 3, (0, 1))]
    assert cross_pieces([], F32) == []


@pytest.mark.parametrize("members", [((0, 1), (2, 3)), ((0, 1, 2), (3,)), ((0,), (1, 2), (3,)),
                                     ((0, 1), (2, 3, 4)), ((0, 1, 2, 3), (4, 5), (6, 7, 8))])
@pytest.mark.parametrize("count,itemsize", [(1, 1), (17, 8), (1000, 4), (16384, 4),
                                            (70001, 1), (12345, 8), (1 << 20, 4),
                                            (9 << 20, 1)])
def test_segments_tile_the_buffer_each_within_one_share_per_host(members, count, itemsize):
    hosts = Hosts(members)
    segments = reduce_segments(hosts, count, itemsize)
    assert segments[0].lo == 0 and segments[-1].hi == count
    assert all(a.hi == b.lo for a, b in zip(segments, segments[1:]))
    assert all(s.hi > s.lo for s in segments)
    for s in segments:
        assert len(s.group) == hosts.count
        for h, rank in enumerate(s.group):
            host, local = hosts.locate(rank)
            assert host == h
            bounds = share_bounds(count, itemsize, len(members[h]))
            assert bounds[local] <= s.lo and s.hi <= bounds[local + 1]
    # each rank's segments cover exactly its share, in order (it runs them in that order)
    for h, ranks in enumerate(members):
        bounds = share_bounds(count, itemsize, len(ranks))
        for local, rank in enumerate(ranks):
            mine = my_segments(segments, rank)
            covered = sum(s.hi - s.lo for s in mine)
            assert covered == bounds[local + 1] - bounds[local]
            assert mine == sorted(mine, key=lambda s: s.lo)
            # cut into pieces, they still tile the share in order, each in its segment's group
            cut = cross_pieces(mine, itemsize)
            assert sum(p.hi - p.lo for p in cut) == covered
            assert all(a.hi <= b.lo for a, b in zip(cut, cut[1:]))
            assert all(any(s.lo <= p.lo < p.hi <= s.hi and s.group == p.group for s in mine)
                       for p in cut)
    # every member of a group cuts its segment the same way (so their allreduces pair up)
    for s in segments:
        cuts = {tuple(p for p in cross_pieces(my_segments(segments, rank), itemsize)
                      if p.group == s.group and s.lo <= p.lo < s.hi) for rank in s.group}
        assert len(cuts) == 1


def test_allgather_groups_homogeneous_are_equal_local_ranks():
    assert gather_groups(Hosts(((0, 1), (2, 3)))) == [GatherGroup((0, 2), (True, True)),
                                                      GatherGroup((1, 3), (True, True))]


def test_allgather_groups_heterogeneous():
    assert gather_groups(Hosts(((0, 1, 2), (3,)))) == [
        GatherGroup((0, 3), (True, True)), GatherGroup((1, 3), (True, False)),
        GatherGroup((2, 3), (True, False))]
    assert gather_groups(Hosts(((0,), (1, 2), (3,)))) == [
        GatherGroup((0, 1, 3), (True, True, True)), GatherGroup((0, 2, 3), (False, True, False))]


@pytest.mark.parametrize("members", [((0, 1), (2, 3)), ((0, 1, 2), (3,)), ((0,), (1, 2), (3,)),
                                     ((0, 1), (2, 3, 4)), ((0, 1, 2, 3), (4, 5), (6, 7, 8))])
def test_allgather_every_rank_s_rows_reach_every_host_once(members):
    hosts = Hosts(members)
    groups = gather_groups(hosts)
    contributed = [m for g in groups for m, gives in zip(g.group, g.contributes) if gives]
    assert sorted(contributed) == sorted(r for ranks in members for r in ranks)
    for g in groups:   # one member per host, each a rank of that host
        assert [hosts.locate(m)[0] for m in g.group] == list(range(hosts.count))
