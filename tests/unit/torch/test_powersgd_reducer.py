"""PowerSGDReducer in one process, its collectives replaced by fakes of a world of one rank
(an allreduce returns its input): when compression starts, what a new world (an elastic reset)
and a join do to the state, backward_passes_per_step, and misuse.  Pure logic, no MPI."""
import pytest
import torch

import hvdlite.torch as hvd
from hvdlite.torch import powersgd_reducer as module
from hvdlite.torch.compression import Compression
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.reducer import OptimizerMisuseError


class FakeHandle:
    def __init__(self, result) -> None:
        self._result = result

    def wait(self):
        return self._result


class FakeEngine:
    """Stands for an engine (a new one after an elastic reset) of a set of two ranks (one rank
    alone would submit nothing: its reductions are the identity)."""

    size = 2


class FakeCore:
    def __init__(self) -> None:
        self.engine_object = FakeEngine()
        self.names: list[str] = []
        self.handed: list[list] = []   # the tensors of every grouped allreduce

    def engine(self, process_set, what):
        return self.engine_object, None

    def grouped(self, tensors, name, op, prescale_factor, postscale_factor, **kwargs):
        self.names.append(name.rsplit(".", 1)[1])
        self.handed.append(list(tensors))
        return FakeHandle(tensors)

    def single(self, tensor, name, op, **kwargs):
        self.names.append(name.rsplit(".", 1)[1])
        return FakeHandle(tensor)


@pytest.fixture
def fake(monkeypatch) -> FakeCore:
    core = FakeCore()
    monkeypatch.setattr(module, "process_set_engine", core.engine)
    monkeypatch.setattr(module, "grouped_allreduce_async_", core.grouped)
    monkeypatch.setattr(module, "allreduce_async_", core.single)
    return core


def setup(passes=1, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 2))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=Compression.powersgd(**kwargs),
                               backward_passes_per_step=passes)
    return model, opt


def train_step(model, opt, passes=1):
    opt.zero_grad()
    for _ in range(passes):
        model(torch.ones(3, 16)).sum().backward()
    opt.step()


def test_plain_then_compressed_and_a_new_world_starts_over(fake):
    model, opt = setup(rank=1, start_iter=2)
    for _ in range(3):
        train_step(model, opt)
    # two plain steps, then P and Q with the small 2x12 weight and the biases in the bucket
    assert fake.names == ["plain", "plain", "uncompressed", "P", "Q"]
    state = opt._reducer.state
    assert set(state.q) == {"allreduce.0.weight"} and set(state.error) == {"allreduce.0.weight"}
    fake.engine_object = FakeEngine()   # what an elastic reset leaves: a new engine
    fake.names.clear()
    train_step(model, opt)
    assert fake.names == ["plain"] and state.counter.steps == 1 and not state.q


def test_world_of_one_rank_1_error_feedback_keeps_the_rest(fake):
    """With one rank, the applied gradient plus the kept error is the gradient plus the
    previous error: nothing is lost."""
    model, opt = setup(rank=1, start_iter=0)
    weight = model[0].weight
    grad = torch.randn(12, 16)
    weight.grad = grad.clone()
    opt.synchronize()
    error = opt._reducer.state.error["allreduce.0.weight"]
    torch.testing.assert_close(weight.grad + error, grad)


def test_passes_per_step_compresses_the_accumulated_gradient_once(fake):
    model, opt = setup(passes=2, rank=1, start_iter=0)
    train_step(model, opt, passes=2)
    assert fake.names == ["uncompressed", "P", "Q"]
    assert opt._reducer.state.counter.steps == 1
    opt.zero_grad()
    for _ in range(2):
        model(torch.ones(3, 16)).sum().backward()
    with pytest.raises(OptimizerMisuseError, match="backward_passes_per_step=2"):
        model(torch.ones(3, 16)).sum().backward()


def test_join_drops_factors_and_agrees_on_the_count(fake):
    model, opt = setup(rank=1, start_iter=0)
    train_step(model, opt)
    opt._reducer.forget_first_step()   # what hvd.join()'s listener calls on every rank
    assert not opt._reducer.state.q and not opt._reducer.state.error
    fake.names.clear()
    train_step(model, opt)
    assert fake.names[0] == "steps" and opt._reducer.state.counter.steps == 2


def test_channels_last_gradients_go_out_contiguous_in_the_wire_dtype(fake):
    """An in-place allreduce needs contiguous tensors: a cast to the wire dtype keeps a
    channels-last gradient's layout unless it is told not to."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=Compression.powersgd(start_iter=5,
                                                                dtype=torch.float16))
    model(torch.ones(2, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
    assert not model.weight.grad.is_contiguous()
    opt.step()
    assert fake.names == ["plain"]
    assert all(t.is_contiguous() and t.dtype == torch.float16 for t in fake.handed[0])


def test_refused_ops():
    model = torch.nn.Linear(4, 4)
    for op in (hvd.Max, hvd.Adasum):
        with pytest.raises(ValueError, match="Average and op=Sum only"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 compression=Compression.powersgd(), op=op)
