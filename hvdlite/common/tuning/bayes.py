"""Bayesian optimization of the continuous parameters, as Horovod's
``horovod/common/optim/bayesian_optimization.cc`` does it: a Gaussian process (scikit-learn's
:class:`~sklearn.gaussian_process.GaussianProcessRegressor`) fitted to the scores seen so far,
and the next point where the expected improvement is largest."""
from __future__ import annotations

import math
import warnings

import numpy as np

# Expected improvement's exploration margin (Horovod's xi).
XI = 0.01
# Random candidates the expected improvement is evaluated at (2 dimensions: dense enough).
CANDIDATES = 2000


def require_sklearn():
    """scikit-learn's Gaussian process, or an ImportError that says how to get it."""
    try:
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern
    except ImportError:
        raise ImportError("autotune (HOROVOD_AUTOTUNE / --autotune) needs scikit-learn: "
                          "pip install scikit-learn") from None
    return GaussianProcessRegressor, ConstantKernel, Matern


class BayesianOptimizer:
    """Proposes points within ``bounds`` (one (low, high) per dimension) that maximize a noisy
    score.  ``noise``: the standard deviation the process assumes in the scores, normalized
    to unit variance (Horovod's ``gaussian_process_noise``).  Deterministic given ``seed``."""

    def __init__(self, bounds: list[tuple[float, float]], noise: float, seed: int = 0) -> None:
        self.bounds = np.array(bounds, dtype=float)
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.xs: list[list[float]] = []
        self.ys: list[float] = []
        self._gp_parts = require_sklearn()

    def clear(self) -> None:
        self.xs, self.ys = [], []

    def add_sample(self, x, y: float) -> None:
        self.xs.append([float(v) for v in x])
        self.ys.append(float(y))

    def _unit(self, x: np.ndarray) -> np.ndarray:
        low, high = self.bounds[:, 0], self.bounds[:, 1]
        return (x - low) / np.where(high > low, high - low, 1.0)

    def next_sample(self) -> list[float]:
        """The point of largest expected improvement over the best score so far."""
        low, high = self.bounds[:, 0], self.bounds[:, 1]
        candidates = low + self.rng.random((CANDIDATES, len(self.bounds))) * (high - low)
        if len(self.ys) < 2:
            return candidates[0].tolist()
        regressor, constant, matern = self._gp_parts
        from scipy.special import ndtr   # (scipy comes with scikit-learn)
        # Scores normalized here (not by normalize_y) so that noise is in their units.
        ys = np.array(self.ys)
        scale = ys.std() or 1.0
        target = (ys - ys.mean()) / scale
        gp = regressor(kernel=constant(1.0, (1e-2, 1e2)) * matern(0.3, (1e-2, 1e1), nu=2.5),
                       alpha=max(self.noise, 1e-6) ** 2, n_restarts_optimizer=0,
                       random_state=int(self.rng.integers(2**31)))
        with warnings.catch_warnings():   # a length scale at its bound is no error here
            warnings.simplefilter("ignore")
            gp.fit(self._unit(np.array(self.xs)), target)
        mean, std = gp.predict(self._unit(candidates), return_std=True)
        best = target.max()
        improvement = mean - best - XI
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(std > 0, improvement / std, 0.0)
        cdf = ndtr(z)
        pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        expected = np.where(std > 0, improvement * cdf + std * pdf, 0.0)
        return candidates[int(np.argmax(expected))].tolist()
