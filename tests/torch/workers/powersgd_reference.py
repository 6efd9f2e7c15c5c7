"""A numpy reference of PowerSGD as DistributedOptimizer runs it, from every rank's gradients
(used by tests/unit/torch/test_powersgd.py and torch_powersgd_worker.py).

Only the random initial Q is drawn with torch (its generator is what fixes the numbers); the
rest (power step, Gram-Schmidt, error feedback, warm start, the compression-rate rule) is
written out here independently of hvdlite/torch/powersgd.py.
"""
import numpy as np
import torch

from hvdlite.common.core import powersgd_policy as policy


def gram_schmidt(matrix, epsilon=0.0):
    out = np.array(matrix, dtype=np.float64, copy=True)
    for i in range(out.shape[1]):
        norm = np.linalg.norm(out[:, i])
        out[:, i] /= (norm if norm > 0 else 1.0) if epsilon == 0 else norm + epsilon
        for j in range(i + 1, out.shape[1]):
            out[:, j] -= np.dot(out[:, i], out[:, j]) * out[:, i]
    return out


def initial_q(config, name, m, r, step=0):
    g = torch.Generator().manual_seed(policy.factor_seed(config, name, step))
    return gram_schmidt(torch.randn(m, r, generator=g, dtype=torch.float32).double().numpy())


class Reference:
    """PowerSGD over ``world`` ranks; ``step(grads)`` takes ``grads[rank][name]`` (numpy) and
    returns the reduced gradient per name, keeping Q and every rank's error feedback."""

    def __init__(self, config, world, average=True):
        self.config, self.world, self.average = config, world, average
        self.steps = 0
        self.q, self.error = {}, [dict() for _ in range(world)]

    def step(self, grads):
        names = list(grads[0])
        out = {}
        compressing = self.steps >= self.config.start_iter
        for name in names:
            shape = grads[0][name].shape
            total = sum(g[name].astype(np.float64) for g in grads)
            if not compressing or not policy.compresses(shape, self.config):
                out[name] = total / self.world if self.average else total
                continue
            n, m = shape[0], int(np.prod(shape[1:]))
            r = min(self.config.rank, n, m)
            q = self.q.get(name) if self.config.warm_start else None
            if q is None:
                q = initial_q(self.config, name, m, r,
                              0 if self.config.warm_start else self.steps)
            mats = []
            for rank in range(self.world):
                mat = grads[rank][name].reshape(n, m).astype(np.float64)
                mats.append(mat + self.error[rank].get(name, 0.0))
            p = gram_schmidt(sum(mat @ q for mat in mats), self.config.epsilon)
            q_locals = [mat.T @ p for mat in mats]
            if self.config.error_feedback:
                for rank in range(self.world):
                    self.error[rank][name] = mats[rank] - p @ q_locals[rank].T
            q_new = sum(q_locals) / (self.world if self.average else 1)
            if self.config.warm_start:
                self.q[name] = q_new
            out[name] = (p @ q_new.T).reshape(shape)
        self.steps += 1
        return out
