"""What the data paths share (hvdlite/common/data_paths/helpers.py) and choosing a path for a
batch (hvdlite/common/engine/data_path.py), in-process: packing a batch into the fusion
buffer, scattering a result held in pieces back into the outputs, the scaling rules."""
from types import SimpleNamespace

import numpy as np
import pytest

from hvdlite.common.data_paths.helpers import (allreduce_alone, copy_out_pieces, displacements,
                                               flat, pack, postscale_factor, row_layout)
from hvdlite.common.engine.data_path import select
from hvdlite.common.reduce_ops import ReduceOp


def response(reduce_op=ReduceOp.Sum, prescale=1.0, postscale=1.0, dtype="float32",
             name="t", kind=0, device=-1):
    return SimpleNamespace(reduce_op=reduce_op, prescale=prescale, postscale=postscale,
                           dtype=dtype, name=name, kind=kind, device=device)


def entry(values, stand_in=False, output=None):
    array = np.asarray(values, dtype=np.float32)
    return SimpleNamespace(array=array, stand_in=stand_in,
                           output=np.empty_like(array) if output is None else output)


def test_pack_puts_inputs_back_to_back_and_prescales():
    batch = [(response(), entry([[1, 2], [3, 4]])), (response(), entry([5, 6, 7]))]
    buf = np.empty(7, dtype=np.float32)
    pack(batch, buf, [4, 3], prescale=0.5)
    assert buf.tolist() == [0.5, 1, 1.5, 2, 2.5, 3, 3.5]


def test_pack_leaves_a_joined_ranks_stand_ins_unscaled():
    # a stand-in holds the reduction's identity: scaling it would change the result (Product)
    batch = [(response(), entry([2, 2])), (response(), entry([1, 1, 1], stand_in=True)),
             (response(), entry([4]))]
    buf = np.empty(6, dtype=np.float32)
    pack(batch, buf, [2, 3, 1], prescale=3.0)
    assert buf.tolist() == [6, 6, 1, 1, 1, 12]


@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_copy_out_pieces_scatters_across_piece_boundaries(factor):
    result = np.arange(10, dtype=np.float32)
    # pieces cut where no output ends: outputs 3 + 4 + 3 elements over pieces 0-2, 2-8, 8-10
    pieces = [(0, 2, result[0:2]), (2, 8, result[2:8]), (8, 10, result[8:10])]
    outputs = [np.empty(3, np.float32), np.empty(4, np.float32), np.empty(3, np.float32)]
    copy_out_pieces(outputs, [3, 4, 3], pieces, factor)
    assert np.concatenate(outputs).tolist() == (result * factor).tolist()


def test_copy_out_pieces_with_one_piece():
    result = np.arange(5, dtype=np.float32)
    outputs = [np.empty(2, np.float32), np.empty(3, np.float32)]
    copy_out_pieces(outputs, [2, 3], [(0, 5, result)], 1.0)
    assert [o.tolist() for o in outputs] == [[0, 1], [2, 3, 4]]


def test_postscale_factor_averages_over_the_ranks():
    assert postscale_factor(response(ReduceOp.Sum, postscale=2.0), 4) == 2.0
    assert postscale_factor(response(ReduceOp.Average, postscale=2.0), 4) == 0.5
    assert postscale_factor(response(ReduceOp.Average), 1) == 1.0


def test_allreduce_alone_copies_and_scales():
    e = entry([1, 2, 3])
    allreduce_alone(response(ReduceOp.Average, prescale=2.0, postscale=3.0), e, 2)
    assert e.output.tolist() == [3, 6, 9]
    assert e.array.tolist() == [1, 2, 3]   # out of place: the input is untouched


def test_flat_reuses_one_dimensional_arrays():
    a = np.zeros(4)
    assert flat(a) is a
    assert flat(np.zeros((2, 3))).shape == (6,)


def test_row_layout_and_displacements():
    assert row_layout((5, 2, 3)) == ((2, 3), 6)
    assert row_layout((7,)) == ((), 1)
    assert displacements([3, 0, 2, 4]) == [0, 3, 3, 5]


class Path:
    def __init__(self, serves):
        self.serves = serves

    def enabled(self, batch):
        return self.serves


def test_select_takes_the_first_path_that_serves_the_batch():
    first, second, third = Path(False), Path(True), Path(True)
    assert select([first, second, third], [(response(), entry([1]))]) is second


def test_select_names_the_batch_no_path_serves():
    with pytest.raises(RuntimeError, match="no data path serves .* of 'grad.w'"):
        select([Path(False)], [(response(name="grad.w"), entry([1]))])
