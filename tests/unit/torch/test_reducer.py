"""hvdlite.torch.reducer (with cohorts.py and grad_layouts.py): the DistributedOptimizer's
gradient Reducer in one process, its submissions replaced by fakes whose handles "reduce" a
tensor as the average with another rank holding twice its gradient (x 1.5).  Pure logic, no
MPI: which gradients go in which bucket or cohort, the order of submissions from the hooks,
backward_passes_per_step, synchronize() and its errors."""
from types import SimpleNamespace

import pytest
import torch

from hvdlite.torch import buckets as buckets_module
from hvdlite.torch import grad_layouts as layouts_module
from hvdlite.torch import reducer as reducer_module
from hvdlite.torch.cohorts import Cohorts
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.reducer import OptimizerMisuseError

AVERAGED = 1.5   # the fake reduction: the mean with a rank whose gradient is twice this one's


class FakeHandle:
    def __init__(self, result) -> None:
        self._result = result

    def wait(self):
        return self._result()


class FakeCore:
    """The reducer's view of the core: submissions in order (``names``), one stream-aware
    engine, bucket plans that every rank agrees on, and names whose reduction fails."""

    def __init__(self, bucket_bytes: int) -> None:
        self.names: list[str] = []
        self.votes: list[str] = []   # layout votes (each gradient's first reduction)
        self.failing: set[str] = set()
        self.streams = 0   # streams open now
        self.others_layout = 0   # the other rank's gradients: dense (-1: none)
        self.config = SimpleNamespace(gradient_bucket_bytes=bucket_bytes)

    def stream_open(self) -> None:
        self.streams += 1

    def stream_close(self) -> None:
        self.streams -= 1

    def engine(self, process_set, what):
        return self, None

    def reduce(self, tensor: torch.Tensor, name: str) -> FakeHandle:
        self.names.append(name)

        def result():
            if name in self.failing:
                raise RuntimeError(f"{name} failed")
            return tensor.mul_(AVERAGED)

        return FakeHandle(result)

    def allreduce_async_(self, tensor, name, op, prescale_factor, postscale_factor,
                         process_set):
        return self.reduce(tensor, name)

    def bucket_submit(self, bucket, op, prescale, postscale, process_set):
        return self.reduce(bucket.pack(), bucket.name)

    def vote(self, codes, name, process_set):
        self.votes.append(name)
        return FakeHandle(lambda: torch.tensor([max(c, self.others_layout) for c in codes]))


@pytest.fixture(params=[0, 1 << 20], ids=["no_buckets", "buckets"])
def fake(request, monkeypatch) -> FakeCore:
    core = FakeCore(request.param)
    monkeypatch.setattr(reducer_module, "allreduce_async_", core.allreduce_async_)
    monkeypatch.setattr(reducer_module, "process_set_engine", core.engine)
    monkeypatch.setattr(buckets_module, "process_set_engine", core.engine)
    monkeypatch.setattr(buckets_module, "allreduce", lambda t, **kwargs: t)   # plans agree
    monkeypatch.setattr(buckets_module.GradientBucket, "submit",
                        lambda bucket, *args: core.bucket_submit(bucket, *args))
    monkeypatch.setattr(layouts_module, "vote_layouts_async", core.vote)
    return core


def model_and_optimizer(layers: int = 3, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), **kwargs)
    return model, opt


def local_grads(model, passes: int = 1) -> dict:
    """Each parameter's gradient of ``passes`` backward passes, without any reduction."""
    copy = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in model])
    copy.load_state_dict(model.state_dict())
    for i in range(passes):
        copy(batch(i)).sum().backward()
    return {name: p.grad.clone() for name, p in copy.named_parameters()}


def batch(i: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).view(2, 4) / 8 + i


def check_averaged(model, expected: dict) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name] * AVERAGED, msg=name)


def test_backward_submits_from_the_hooks_and_writes_the_averages(fake):
    model, opt = model_and_optimizer()
    reducer = opt._reducer
    fired = []
    on_grad_ready = reducer.on_grad_ready

    def spy(p):
        # each gradient is submitted by its own hook, before the next hook fires
        fired.append((reducer.names[p], len(fake.names)))
        on_grad_ready(p)

    reducer.on_grad_ready = spy
    expected = local_grads(model)
    model(batch(0)).sum().backward()
    assert [name for name, _ in fired] == fake.names   # one submission per hook, in its order
    assert [count for _, count in fired] == list(range(len(fired)))
    # last layer first: the backward pass reaches it first
    assert fake.names[0].startswith("allreduce.2.") and fake.names[-1].startswith("allreduce.0.")
    check_averaged(model, expected)   # written at the end of backward, before step()
    assert reducer.fresh and not reducer.handles and fake.streams == 0
    opt.synchronize()   # already reduced: nothing more to submit
    assert len(fake.names) == len(fired)
    opt.step()


def test_small_gradients_share_buckets_after_the_first_step(fake):
    model, opt = model_and_optimizer(layers=4)
    reducer = opt._reducer
    model(batch(0)).sum().backward()
    opt.step()
    opt.zero_grad()
    params = list(reducer.names)
    if fake.config.gradient_bucket_bytes == 0:   # buckets off: every gradient on its own
        assert not reducer.buckets
    else:
        assert reducer.buckets, "no buckets planned"
        bucketed = [p for b in reducer.buckets for p in b.params]
        assert len(bucketed) == len(set(bucketed)) == len(params)   # each exactly once
        position = {id(p): i for i, p in enumerate(params)}
        order = [position[id(p)] for p in bucketed]
        assert order == sorted(order, reverse=True), "buckets follow the hooks' order"
        assert all(reducer.bucket_of[p] is b for b in reducer.buckets for p in b.params)
    fake.names.clear()
    expected = local_grads(model)
    model(batch(0)).sum().backward()
    expected_names = ([b.name for b in reducer.buckets] if reducer.buckets
                      else [reducer.names[p] for p in reversed(params)])
    assert sorted(fake.names) == sorted(expected_names)   # one submission per bucket
    check_averaged(model, expected)


def test_backward_passes_per_step_accumulates_locally(fake):
    model, opt = model_and_optimizer(backward_passes_per_step=2)
    expected = local_grads(model, passes=2)
    model(batch(0)).sum().backward()
    assert fake.names == [] and not opt._reducer.fresh   # first pass: nothing submitted
    model(batch(1)).sum().backward()
    assert len(fake.names) == len(list(model.parameters()))
    check_averaged(model, expected)   # the sum of both passes, averaged once
    with pytest.raises(OptimizerMisuseError, match="backward_passes_per_step=2"):
        model(batch(2)).sum().backward()   # a third pass before step()
    assert fake.streams == 0


def test_synchronize_reduces_a_pass_short_of_the_count(fake):
    model, opt = model_and_optimizer(backward_passes_per_step=3)
    expected = local_grads(model)
    model(batch(0)).sum().backward()
    assert fake.names == []
    opt.synchronize()   # clipping after fewer passes: reduce what there is, on every rank
    assert len(fake.names) == len(list(model.parameters()))
    check_averaged(model, expected)
    with opt.skip_synchronize():
        opt.step()
    assert len(fake.names) == len(list(model.parameters())), "reduced twice"


@pytest.mark.parametrize("others_layout", [0, -1], ids=["others_have_it", "nobody_has_it"])
def test_an_unused_parameter_takes_part_with_zeros(fake, others_layout):
    fake.others_layout = others_layout
    model, opt = model_and_optimizer()
    model[0](batch(0)).sum().backward()   # only the first layer has gradients here
    everyone = sorted(f"allreduce.{n}" for n, _ in model.named_parameters())
    assert sorted(fake.votes) == [f"{n}.layout" for n in everyone]   # first reductions
    used = [f"allreduce.0.{n}" for n in ("bias", "weight")]
    # a rank without the gradient joins the reduction the others started, with zeros; when
    # no rank has one, the zeros are the result without any reduction
    assert sorted(fake.names) == (everyone if others_layout == 0 else used)
    for name, p in model.named_parameters():
        if not name.startswith("0."):
            assert torch.equal(p.grad, torch.zeros_like(p)), name


def test_a_failed_reduction_is_raised_after_all_others_are_written(fake):
    model, opt = model_and_optimizer(backward_passes_per_step=2)
    expected = local_grads(model)
    model(batch(0)).sum().backward()
    fake.failing.add("allreduce.1.weight")
    with pytest.raises(RuntimeError, match="allreduce.1.weight failed"):
        opt.synchronize()
    assert not opt._reducer.in_flight() and not opt._reducer.handles
    for name, p in model.named_parameters():
        if name != "1.weight":
            torch.testing.assert_close(p.grad, expected[name] * AVERAGED, msg=name)
    fake.failing.clear()
    model(batch(0)).sum().backward()   # the counts restarted: a fresh accumulation
    model(batch(1)).sum().backward()


def test_a_cohort_is_submitted_together_once_complete(fake):
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    cohort = [model[0].weight, model[2].bias]   # the first and the last hook to fire
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), groups=[cohort])
    reducer = opt._reducer
    fired = []
    on_grad_ready = reducer.on_grad_ready
    reducer.on_grad_ready = lambda p: (fired.append(reducer.names[p]), on_grad_ready(p))
    for step in range(2):
        fake.names.clear()
        fired.clear()
        model(batch(step)).sum().backward()
        together = ["allreduce.0.weight", "allreduce.2.bias"]
        # the cohort goes when its last member's gradient is complete, both at once
        assert fake.names[-2:] == together, fake.names
        assert fired[-1] == "allreduce.0.weight" and fired[0] == "allreduce.2.bias"
        assert not any(p in reducer.bucket_of for p in cohort), "a cohort member in a bucket"
        opt.step()
        opt.zero_grad()


def test_cohorts_from_groups():
    a, b, c, d = (torch.zeros(1, requires_grad=True) for _ in range(4))
    names = {a: "a", b: "b", c: "c", d: "d"}
    dealt = Cohorts.from_groups(names, 2)
    assert dealt.members == [[a, c], [b, d]] and dealt.of[c] == 0 and dealt.of[d] == 1
    assert Cohorts.from_groups(names, None).of == {}
    listed = Cohorts.from_groups(names, [[b, a]])
    assert listed.complete(a) is None
    assert listed.complete(b) == [b, a]
    assert listed.complete(a) is None, "a completed cohort starts over"
    listed.clear()
    assert listed.complete(b) is None
    with pytest.raises(ValueError, match="positive"):
        Cohorts.from_groups(names, 0)
    with pytest.raises(ValueError, match="not one of"):
        Cohorts.from_groups(names, [[torch.zeros(1)]])
    with pytest.raises(ValueError, match="'a' appears in two groups"):
        Cohorts.from_groups(names, [[a, b], [a]])


def test_zero_grad_discards_a_fresh_reduction_and_restarts_the_count(fake):
    model, opt = model_and_optimizer(backward_passes_per_step=2)
    model(batch(0)).sum().backward()
    model(batch(1)).sum().backward()
    assert opt._reducer.fresh
    opt.zero_grad()   # a GAN's other optimizer, or a step GradScaler skipped
    assert not opt._reducer.fresh
    fake.names.clear()
    model(batch(0)).sum().backward()
    assert fake.names == [], "the count did not restart"
