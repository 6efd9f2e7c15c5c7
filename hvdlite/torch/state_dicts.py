"""Loading an optimizer's state without replacing its param-group dicts (what a learning-rate
scheduler holds); shared by state broadcasts and the DistributedOptimizer wrapper."""
from __future__ import annotations

import torch


def load_state_keeping_groups(optimizer: torch.optim.Optimizer, state_dict: dict,
                              load=None) -> None:
    """``optimizer.load_state_dict(state_dict)`` (or ``load(state_dict)``), except that the
    loaded hyper-parameters are written into the param-group dicts (and the list) that the
    optimizer already has, where torch replaces them with new ones.  A learning-rate scheduler
    made for the optimizer before it was wrapped or its state broadcast (Horovod's examples do
    both) holds those dicts, directly or through the unwrapped optimizer, whose groups the
    DistributedOptimizer shares: with new dicts it would go on scheduling a learning rate that
    no optimizer steps with."""
    groups = optimizer.param_groups
    kept = list(groups)
    (load or optimizer.load_state_dict)(state_dict)
    for old, new in zip(kept, optimizer.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    groups[:] = kept
    optimizer.param_groups = groups
