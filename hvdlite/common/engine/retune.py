"""Autotune inside the engine: after each round, feed the parameter manager (see
:mod:`hvdlite.common.tuning.manager`) what ran; when a sample ends (the same round on every
rank), take rank 0's next setting with one small allgather and switch to it before the next
round, on every rank.  A switch therefore never falls inside a round: a round's responses all
run with the setting they were negotiated under, and none is dropped or reordered (pending
entries the response cache knew are negotiated in full when it is switched off)."""
from __future__ import annotations

import dataclasses

import numpy as np

from hvdlite.common.config import Config
from hvdlite.common.engine.controller import RoundOutcome
from hvdlite.common.runtime.waiting import wait_until
from hvdlite.common.tuning.manager import ParameterManager, TuningOptions
from hvdlite.common.tuning.parameter_space import Setting

VECTOR = 6   # a setting's five floats, then "still tuning"


def configured_setting(config: Config) -> Setting:
    """The setting the configuration asks for (autotune measures it first)."""
    return Setting(config.fusion_threshold / 2**20, config.cycle_time_ms,
                   config.cache_capacity > 0, config.hierarchical_allreduce,
                   config.hierarchical_allgather)


def tuning_options(config: Config) -> TuningOptions:
    return TuningOptions(config.autotune_warmup_samples, config.autotune_steps_per_sample,
                         config.autotune_bayes_opt_max_samples,
                         config.autotune_gaussian_process_noise, config.autotune_log)


def spans_hosts(comm) -> bool:
    """Whether the ranks of ``comm`` run on more than one host (collective)."""
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        first_here = 1 if local.Get_rank() == 0 else 0
    finally:
        local.Free()
    return comm.allreduce(first_here) > 1


class Retuner:
    """Switches ``engine`` (an :class:`~hvdlite.common.engine.engine.Engine`) between the
    settings ``manager`` decides.  ``history``: (round, setting) of every switch, the same on
    every rank (tests)."""

    def __init__(self, engine, manager: ParameterManager) -> None:
        self.engine = engine
        self.manager = manager
        self.base_capacity = engine.config.cache_capacity or Config().cache_capacity
        self.history: list[tuple[int, Setting]] = []
        self.apply(manager.current)

    def after_round(self, outcome: RoundOutcome) -> None:
        """Between rounds: count what ran; at a sample's end, switch to rank 0's setting."""
        manager = self.manager
        if not manager.active:
            return
        names, nbytes = [], 0
        ran = outcome.ready if outcome.early is None else outcome.ready + [outcome.early]
        for response, entry in ran:
            if response.error is None:
                names.append(response.name)
                if entry is not None and entry.nbytes:
                    nbytes += entry.nbytes
        if not names or not manager.update(names, nbytes):
            return
        controller = self.engine.controller
        mine = np.array(manager.current.to_vector() + [float(manager.active)])
        every = np.empty(VECTOR * controller.size)
        wait_until(controller.transport.start_allgather(mine, every), controller.max_sleep,
                   on_slow=lambda waited: controller.local_stall(waited, "autotune's broadcast"))
        chosen = every[:VECTOR]   # rank 0's
        setting = Setting.from_vector(chosen)
        manager.accept(setting, bool(chosen[-1] > 0.5))
        self.apply(setting)
        if not manager.active:
            manager.close()

    def apply(self, setting: Setting) -> None:
        """Run with ``setting`` from the next round on (called between rounds, on every rank)."""
        engine = self.engine
        config = dataclasses.replace(
            engine.config, fusion_threshold=setting.fusion_threshold_bytes,
            cycle_time_ms=setting.cycle_time_ms,
            cache_capacity=self.base_capacity if setting.cache_enabled else 0,
            hierarchical_allreduce=setting.hierarchical_allreduce,
            hierarchical_allgather=setting.hierarchical_allgather)
        engine.use_config(config)
        self.history.append((engine.controller.rounds, setting))
