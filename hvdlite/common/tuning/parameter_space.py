"""What autotune tunes: one :class:`Setting` of the engine, the bounds and Horovod's first test
points of the two continuous parameters, and the order in which the on/off ones are swept."""
from __future__ import annotations

import dataclasses
import itertools

MIB = 2**20

# Horovod's bounds (parameter_manager.cc); an upper bound grows to take in the configured value.
FUSION_MB_BOUNDS = (0.0, 64.0)
CYCLE_MS_BOUNDS = (1.0, 100.0)
# Horovod's test points (fusion MB, cycle ms), sampled before the Gaussian process proposes.
TEST_POINTS: tuple[tuple[float, float], ...] = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0),
                                                (8.0, 10.0))
# The log's columns, as Horovod writes them (torus_allreduce: always 0, hvdlite has none).
LOG_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
               "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the search: what the engine runs with between two switches."""

    fusion_threshold_mb: float
    cycle_time_ms: float
    cache_enabled: bool
    hierarchical_allreduce: bool
    hierarchical_allgather: bool

    def to_vector(self) -> list[float]:
        """Five floats (rank 0 sends them to every rank)."""
        return [self.fusion_threshold_mb, self.cycle_time_ms, float(self.cache_enabled),
                float(self.hierarchical_allreduce), float(self.hierarchical_allgather)]

    @classmethod
    def from_vector(cls, values) -> "Setting":
        fusion, cycle, cache, har, hag = (float(v) for v in values[:5])
        return cls(fusion, cycle, cache > 0.5, har > 0.5, hag > 0.5)

    def log_row(self, score: float) -> list[str]:
        """The setting and its score as Horovod's log writes them (bools as 0/1, MB)."""
        return [str(int(self.hierarchical_allreduce)), str(int(self.hierarchical_allgather)),
                "0", str(int(self.cache_enabled)), f"{self.cycle_time_ms:g}",
                f"{self.fusion_threshold_mb:g}", f"{score:g}"]

    @property
    def fusion_threshold_bytes(self) -> int:
        return int(self.fusion_threshold_mb * MIB)


@dataclasses.dataclass(frozen=True)
class ParameterSpace:
    """The continuous bounds and the on/off combinations to sweep.  ``spans_hosts``: the job
    runs on several hosts (otherwise the hierarchical switches are not tuned: they change
    nothing on one host)."""

    fusion_bounds: tuple[float, float] = FUSION_MB_BOUNDS
    cycle_bounds: tuple[float, float] = CYCLE_MS_BOUNDS
    spans_hosts: bool = False
    start: Setting | None = None   # the configured setting (measured first)

    @classmethod
    def around(cls, start: Setting, spans_hosts: bool) -> "ParameterSpace":
        """Horovod's bounds, widened to include the configured ``start``."""
        return cls((min(FUSION_MB_BOUNDS[0], start.fusion_threshold_mb),
                    max(FUSION_MB_BOUNDS[1], start.fusion_threshold_mb)),
                   (min(CYCLE_MS_BOUNDS[0], start.cycle_time_ms),
                    max(CYCLE_MS_BOUNDS[1], start.cycle_time_ms)), spans_hosts, start)

    @property
    def bounds(self) -> list[tuple[float, float]]:
        return [self.fusion_bounds, self.cycle_bounds]

    def combinations(self) -> list[dict[str, bool]]:
        """The on/off settings in Horovod's order (its parameter chain is an odometer whose
        fastest wheel is hierarchical allreduce, then allgather, then the cache; each starts
        off)."""
        har = (False, True) if self.spans_hosts else (
            (self.start.hierarchical_allreduce if self.start else False),)
        hag = (False, True) if self.spans_hosts else (
            (self.start.hierarchical_allgather if self.start else False),)
        return [{"cache_enabled": cache, "hierarchical_allgather": g,
                 "hierarchical_allreduce": r}
                for cache, g, r in itertools.product((False, True), hag, har)]

    def test_points(self) -> list[tuple[float, float]]:
        """Where each sweep starts: the configured point (so the defaults are always measured),
        then Horovod's four test points."""
        first = [] if self.start is None else [(self.start.fusion_threshold_mb,
                                                self.start.cycle_time_ms)]
        return first + [p for p in TEST_POINTS if p not in first]
