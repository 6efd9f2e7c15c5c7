"""The tuner's logic in one process (tests/core/test_autotune.py runs it under MPI): Horovod's
sample boundaries and warm-up, the same decisions on every rank, the sweep of the on/off
settings with test points then Bayesian proposals, the best sample kept, the log's columns,
and the engine's switch (cache emptied, pending entries negotiated in full)."""
from __future__ import annotations

import sys

import pytest

from hvdlite.common.config import Config
from hvdlite.common.tuning import bayes
from hvdlite.common.tuning.manager import PARTS, ParameterManager, TuningOptions
from hvdlite.common.tuning.parameter_space import (LOG_COLUMNS, TEST_POINTS, ParameterSpace,
                                                   Setting)

NAMES = [f"grad{i}" for i in range(4)]
START = Setting(128.0, 1.0, True, False, False)   # hvdlite's defaults


class Clock:
    """A clock the test advances: a step takes ``cost(setting)`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def throughput(setting: Setting) -> float:
    """A made-up landscape: best at 16 MB and 10 ms with the cache on."""
    return (300.0 - abs(setting.fusion_threshold_mb - 16) - abs(setting.cycle_time_ms - 10)
            + (20.0 if setting.cache_enabled else 0.0))


def manager(tmp_path=None, root=True, **options) -> tuple[ParameterManager, Clock]:
    clock = Clock()
    log = str(tmp_path / "autotune.csv") if tmp_path is not None else None
    opts = TuningOptions(**{"warmup_samples": 1, "steps_per_sample": 2,
                            "bayes_opt_max_samples": 5, "log_file": log, **options})
    return ParameterManager(ParameterSpace.around(START, False), opts, root, clock), clock


def run_step(m: ParameterManager, clock: Clock, nbytes: int = 1000) -> bool:
    """One training step: every name once, in one round; the step's time follows the
    landscape (higher throughput, shorter step)."""
    clock.now += 1.0 / throughput(m.current)
    return m.update(NAMES, nbytes)


def run_to_end(m: ParameterManager, clock: Clock, limit: int = 5000) -> list[int]:
    """Steps until tuning ends (rank 0 accepting its own decisions); the steps that ended a
    scored sample."""
    ends = []
    for step in range(limit):
        if not m.active:
            return ends
        if run_step(m, clock):
            ends.append(step)
            m.accept(m.current, m.active)
    raise AssertionError("tuning did not end")


def test_sample_boundaries_and_warmup():
    m, clock = manager(warmup_samples=2, steps_per_sample=2)
    # as Horovod's Update: a part ends at the round where a name has run steps_per_sample
    # more times; the step that ends a sample's last part belongs to that sample (the counts
    # start over after it): PARTS * steps_per_sample + 1 steps a sample
    ends = [step for step in range(50) if run_step(m, clock) and m.accept(m.current, True)
            is None]
    per_sample = PARTS * 2 + 1
    assert ends[0] == 3 * per_sample - 1   # two warm-up samples first, discarded
    assert ends[1] - ends[0] == per_sample
    assert len(m.samples) == len(ends)


def test_every_rank_decides_the_same_rounds():
    """Only rank 0 scores and chooses, but every rank agrees where a sample ends, whatever its
    clock, so they all meet in the same round's broadcast."""
    root, root_clock = manager()
    other, other_clock = manager(root=False)
    for _ in range(300):
        ended = run_step(root, root_clock)
        other_clock.now += 0.37   # another clock entirely
        assert other.update(NAMES, 1000) == ended
        if ended:
            root.accept(root.current, root.active)
            other.accept(root.current, root.active)   # what the broadcast brings
            assert other.current == root.current
        if not root.active:
            break
    assert not root.active and not other.active
    assert other.samples == []   # only rank 0 scores


def test_sweep_order_and_best_kept(tmp_path):
    m, clock = manager(tmp_path)
    run_to_end(m, clock)
    settings = [s for s, _ in m.samples]
    per_combo = m.options.bayes_opt_max_samples + 1
    assert len(settings) == 2 * per_combo   # cache off, then on (one host: no hierarchical)
    assert [s.cache_enabled for s in settings] == [False] * per_combo + [True] * per_combo
    for combo in (settings[:per_combo], settings[per_combo:]):
        # the configured point first, then Horovod's test points, then Bayesian proposals
        points = [(s.fusion_threshold_mb, s.cycle_time_ms) for s in combo]
        assert points[:5] == [(128.0, 1.0)] + list(TEST_POINTS)
        for fusion, cycle in points[5:]:
            assert 0 <= fusion <= 128 and 1 <= cycle <= 100
    best = max(m.samples, key=lambda sample: sample[1])
    assert m.best == best and m.current == best[0] and best[0].cache_enabled
    # once done, nothing more is counted or decided
    assert not run_step(m, clock)


def test_log_columns_as_horovod(tmp_path):
    m, clock = manager(tmp_path)
    run_to_end(m, clock)
    lines = (tmp_path / "autotune.csv").read_text().splitlines()
    # horovod/common/parameter_manager.cc, ParameterManager::Initialize
    assert lines[0] == ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,"
                        "cache_enabled,cycle_time_ms,tensor_fusion_threshold,score")
    assert tuple(lines[0].split(",")) == LOG_COLUMNS
    rows = [line.split(",") for line in lines[1:]]
    assert len(rows) == len(m.samples) + 1   # every scored sample, then the best
    for row, (setting, score) in zip(rows, m.samples):
        assert row[:4] == ["0", "0", "0", str(int(setting.cache_enabled))]
        assert float(row[4]) == pytest.approx(setting.cycle_time_ms, rel=1e-5)
        assert float(row[5]) == pytest.approx(setting.fusion_threshold_mb, rel=1e-5)
        assert float(row[6]) == pytest.approx(score, rel=1e-5)
    assert rows[-1] == m.best[0].log_row(m.best[1])


def test_hierarchical_swept_only_across_hosts():
    one = ParameterSpace.around(START, spans_hosts=False).combinations()
    many = ParameterSpace.around(START, spans_hosts=True).combinations()
    assert len(one) == 2 and len(many) == 8
    # Horovod's odometer: hierarchical allreduce turns fastest, the cache slowest
    assert [c["hierarchical_allreduce"] for c in many[:2]] == [False, True]
    assert [c["cache_enabled"] for c in many] == [False] * 4 + [True] * 4


def test_bayes_deterministic_and_in_bounds():
    def propose(seed):
        opt = bayes.BayesianOptimizer([(0, 64), (1, 100)], noise=0.8, seed=seed)
        for x, y in [((4, 5), 1.0), ((32, 50), 0.5), ((16, 25), 0.8), ((8, 10), 1.2)]:
            opt.add_sample(x, y)
        return opt.next_sample()
    first = propose(3)
    assert first == propose(3)
    assert 0 <= first[0] <= 64 and 1 <= first[1] <= 100


def test_bayes_finds_a_clear_peak():
    """Low noise, a smooth peak at (40, 70): proposals end near it."""
    def score(x):
        return -((x[0] - 40) / 64) ** 2 - ((x[1] - 70) / 100) ** 2
    opt = bayes.BayesianOptimizer([(0, 64), (1, 100)], noise=0.01, seed=1)
    for x in [(4, 5), (32, 50), (16, 25), (8, 10)]:
        opt.add_sample(x, score(x))
    for _ in range(8):
        x = opt.next_sample()
        opt.add_sample(x, score(x))
    best = max(zip(opt.ys, opt.xs))[1]
    assert abs(best[0] - 40) < 10 and abs(best[1] - 70) < 15, best


def test_missing_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.gaussian_process", None)
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        bayes.require_sklearn()


def test_knobs_read_from_both_spellings():
    config = Config.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv",
                              "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "2",
                              "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                              "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
                              "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3"})
    assert (config.autotune, config.autotune_log, config.autotune_warmup_samples,
            config.autotune_steps_per_sample, config.autotune_bayes_opt_max_samples,
            config.autotune_gaussian_process_noise) == (True, "/tmp/x.csv", 2, 4, 7, 0.3)
    default = Config()
    assert (default.autotune, default.autotune_warmup_samples,
            default.autotune_steps_per_sample, default.autotune_bayes_opt_max_samples,
            default.autotune_gaussian_process_noise) == (False, 3, 10, 20, 0.8)
