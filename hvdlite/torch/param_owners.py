"""Which DistributedOptimizer owns each parameter: its gradient hook and its name on the wire.

Two situations would otherwise send one name twice, which fails (a name already in flight)
or, worse, depends on timing and so differs between ranks:

* a parameter wrapped again (a new optimizer for the next phase of training): the old
  optimizer's hook would keep firing for as long as that optimizer lives (until the garbage
  collector finds it, if it is in a reference cycle);
* two models named alike (a GAN's generator and discriminator, both ``nn.Sequential``) whose
  gradients are in flight together.

A new owner therefore takes over a parameter's hook, and names that another live optimizer
already uses for other parameters are told apart.  Everything here depends only on the order
in which optimizers are created and on which of them are still reachable, never on timing,
so every rank decides the same.
"""
from __future__ import annotations

import gc
import weakref

# id(parameter) -> (weak parameter, weak owning optimizer)
_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _owners.get(key)
    if entry is not None and entry[0] is ref:
        del _owners[key]


def claim(optimizer, params) -> None:
    """Make ``optimizer`` the owner of ``params``; a previous owner drops its hooks on them."""
    for p in params:
        key = id(p)
        entry = _owners.get(key)
        if entry is not None and entry[0]() is p:
            previous = entry[1]()
            if previous is not None and previous is not optimizer:
                previous._release_hook(p)
        ref = weakref.ref(p, lambda r, key=key: _forget(key, r))
        _owners[key] = (ref, weakref.ref(optimizer))


def _names_of_others(optimizer) -> set[str]:
    names = set()
    for p_ref, owner_ref in list(_owners.values()):
        p, owner = p_ref(), owner_ref()
        if p is not None and owner is not None and owner is not optimizer:
            name = getattr(owner, "_names", {}).get(p)
            if name is not None:
                names.add(name)
    return names


def names_taken(optimizer, names) -> set[str]:
    """Those of ``names`` that another live optimizer uses for its own parameters.

    Optimizers that are no longer reachable still hold their names until the cyclic garbage
    collector frees them (their hooks make a cycle), which happens at different times on
    different ranks; so a clash is confirmed after a collection.
    """
    clash = set(names) & _names_of_others(optimizer)
    if clash:
        gc.collect()
        clash = set(names) & _names_of_others(optimizer)
    return clash
