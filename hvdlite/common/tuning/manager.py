"""The parameter manager: Horovod's ``ParameterManager`` (``horovod/common/parameter_manager.cc``)
in Python.

Every rank feeds it each round's executed tensors (:meth:`ParameterManager.update`) and so
agrees, without talking, on where a sample ends: a sample has five parts, each ending when some
tensor has run ``steps_per_sample`` more times; its score is the median of the parts' bytes per
microsecond (rank 0's clock).  The first ``warmup_samples`` are discarded.  After each scored
sample rank 0 picks the next setting and every rank must then take rank 0's
(:meth:`ParameterManager.accept`, after the engine's broadcast).  For each combination of the
on/off settings, in Horovod's order, the fusion threshold and cycle time are sampled at the test
points and then where a Gaussian process expects the most improvement, ``bayes_opt_max_samples``
+ 1 samples in all; then the best sampled setting is kept for the rest of the job.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from hvdlite.common.tuning.bayes import BayesianOptimizer
from hvdlite.common.tuning.log import TuningLog
from hvdlite.common.tuning.parameter_space import ParameterSpace, Setting

PARTS = 5   # parts of a sample; its score is their median (Horovod's SAMPLES)


@dataclasses.dataclass(frozen=True)
class TuningOptions:
    """Horovod's autotune knobs."""

    warmup_samples: int = 3
    steps_per_sample: int = 10
    bayes_opt_max_samples: int = 20
    gaussian_process_noise: float = 0.8
    log_file: str | None = None
    seed: int = 0


class ParameterManager:
    """One per tuned engine, on every rank; ``root``: this rank decides (rank 0).  ``clock``:
    seconds (tests pass their own)."""

    def __init__(self, space: ParameterSpace, options: TuningOptions, root: bool,
                 clock=time.perf_counter) -> None:
        self.space = space
        self.options = options
        self.root = root
        self.clock = clock
        self.active = True
        self.warmup_remaining = options.warmup_samples
        self.samples: list[tuple[Setting, float]] = []   # scored samples (rank 0)
        self.best: tuple[Setting, float] | None = None
        self._combos = space.combinations()
        self._combo = 0
        self._iteration = 0
        self._points = space.test_points()
        self._bayes = BayesianOptimizer(space.bounds, options.gaussian_process_noise,
                                        options.seed) if root else None
        self._log = TuningLog(options.log_file) if root else None
        self.current = self._setting(self._points[0])
        self._reset()

    # --- every rank ----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._counts: dict[str, int] = {}
        self._part = 0
        self._bytes = 0
        self._scores: list[float] = []
        self._part_start = self.clock()

    def update(self, names: Iterable[str], nbytes: int) -> bool:
        """A round ran ``names`` (``nbytes`` in all).  True when this round ends a scored
        sample: rank 0 then has a new :attr:`current` for every rank to :meth:`accept`.  The
        same on every rank, given the same names in the same rounds."""
        if not self.active:
            return False
        steps = max(1, self.options.steps_per_sample)
        for name in names:
            step = self._counts.get(name, 0)
            self._counts[name] = step + 1
            if step >= (self._part + 1) * steps:
                now = self.clock()
                self._scores.append(self._bytes / max((now - self._part_start) * 1e6, 1e-9))
                self._bytes, self._part_start = 0, now
                self._part += 1
                break
        self._bytes += nbytes
        if self._part < PARTS:
            return False
        score = sorted(self._scores)[PARTS // 2]
        if self.warmup_remaining > 0:
            self.warmup_remaining -= 1
            if self._log is not None:
                self._log.warming_up(self.warmup_remaining)
            self._reset()
            return False
        if self.root:
            self._tune(score)
        return True

    def accept(self, setting: Setting, active: bool) -> None:
        """Take rank 0's decision (rank 0 passes its own) and start the next sample."""
        self.current, self.active = setting, active
        self._reset()

    # --- rank 0 --------------------------------------------------------------------------------
    def _setting(self, point) -> Setting:
        return Setting(float(point[0]), float(point[1]), **self._combos[self._combo])

    def _tune(self, score: float) -> None:
        setting = self.current
        self.samples.append((setting, score))
        self._log.sample(setting, score)
        if self.best is None or score > self.best[1]:
            self.best = (setting, score)
        self._bayes.add_sample([setting.fusion_threshold_mb, setting.cycle_time_ms], score)
        self._iteration += 1
        if self._iteration > self.options.bayes_opt_max_samples:   # this combination is done
            self._iteration = 0
            self._combo += 1
            self._bayes.clear()
            if self._combo >= len(self._combos):
                self.active = False
                self.current = self.best[0]
                self._log.best(*self.best)
                return
            self.current = self._setting(self._points[0])
            return
        if self._iteration < len(self._points):
            self.current = self._setting(self._points[self._iteration])
        else:
            self.current = self._setting(self._bayes.next_sample())

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
