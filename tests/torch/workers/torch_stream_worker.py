"""DistributedOptimizer announces each backward's gradients to the engine as a stream
(Engine.stream_open), so that they are negotiated in a few rounds per step rather than a round
every gradient or two, whose fixed cost competes with backward for the interpreter.

Checked on every rank: no stream stays open after a step (also with a parameter that never gets
a gradient, whose hook never fires), training stays identical on all ranks, and at one rank,
where rounds need no peers and so never batch by themselves, the rounds per step.  The job runs
with a long cycle time (HVDLITE_CYCLE_TIME, set by the test) so that a whole backward fits in one
gather however slow the machine is.
"""
import torch
import torch.nn as nn

torch.set_num_threads(1)

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.common.runtime import state
from tests.workers._report import Reporter  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
STEPS = 4


def train_and_count():
    torch.manual_seed(0)
    # Layers that take ~1 ms each in backward: without the stream, nearly every gradient
    # would get a round of its own at one rank.
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])   # 80 gradients
    never = nn.Linear(64, 64)                                        # never gets a gradient
    named = list(model.named_parameters()) + [(f"never.{n}", p)
                                              for n, p in never.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.01),
                                   named_parameters=named)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    engine = state.engine()
    before = engine.rounds_with_work
    for step in range(STEPS):
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(RANK * 100 + step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert engine.open_streams == 0, f"a gradient stream stayed open after step {step}"
    return model, (engine.rounds_with_work - before) / STEPS


def streams_close_and_ranks_agree():
    model, per_step = train_and_count()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="stream.params")
    for k in range(SIZE):
        assert torch.equal(every[k], flat), f"rank {k}'s parameters differ from rank {RANK}'s"
    if SIZE == 1:
        # One round for the 80 streamed gradients, one for the 2 zero gradients that
        # synchronize() adds, some slack; one round per gradient or two without the stream.
        assert per_step <= 4, f"{per_step} negotiation rounds per step for 82 gradients"


def zero_grad_closes_an_unfinished_stream():
    """A backward pass whose stream is still open (a parameter without a gradient, and no
    step: here the first of two accumulation passes, then the accumulation is dropped) must
    not leave the engine gathering: zero_grad() closes it."""
    model, never = nn.Linear(8, 8), nn.Linear(8, 8)
    named = [(f"m.{n}", p) for n, p in model.named_parameters()] + [
        (f"never.{n}", p) for n, p in never.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.01),
                                   named_parameters=named, backward_passes_per_step=2)
    engine = state.engine()
    model(torch.ones(2, 8)).sum().backward()
    assert engine.open_streams == 1, engine.open_streams
    opt.zero_grad()
    assert engine.open_streams == 0, "zero_grad() left the gradient stream open"


r = Reporter(RANK)
r.case("streams_close_and_ranks_agree", streams_close_and_ranks_agree)
r.case("zero_grad_closes_an_unfinished_stream", zero_grad_closes_an_unfinished_stream)
r.write()
hvd.shutdown()
