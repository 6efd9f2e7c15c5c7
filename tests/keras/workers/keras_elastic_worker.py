"""An elastic Keras-JAX job (``hvdlite run --min-np 1 --max-np 2``): model.train_on_batch's
jitted step reduces its gradients inside ``jax.jit``; rank 1 SIGKILLs itself after step
``KILL_AFTER`` of the first world, before committing, so rank 0's next in-jit allreduce fails,
``hvd.elastic.run`` ends the world and the launcher starts world 1 with rank 0's host alone,
which resumes from the last commit.  World 1's rank reports whether it finished every step
with the numpy reference's weights (steps averaged over both ranks' data up to the last commit,
then its own data alone)."""
import os
import signal

import numpy as np
import keras

import hvdlite.keras as hvd
from tests.keras.workers.linear_case import W0, data, local_grad
from tests.workers._report import Reporter

STEPS, KILL_AFTER, LR = 8, 4, 0.1


def reference() -> np.ndarray:
    w = W0.astype(np.float64)
    for step in range(STEPS):
        # Rank 0 committed step KILL_AFTER (its commit is its own); its next step failed in
        # the allreduce and was rolled back to that commit.
        ranks = (0, 1) if step < KILL_AFTER else (0,)
        w = w - LR * np.mean([local_grad(w, *data(q)) for q in ranks], axis=0)
    return w


WORLD = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))   # the launcher's, per process
hvd.init()
report = Reporter(hvd.rank())
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
model.layers[0].set_weights([W0])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
model.optimizer.build(model.trainable_variables)
state = hvd.elastic.KerasState(model, step=0)


@hvd.elastic.run
def train(state):
    x, y = data(hvd.rank())
    while state.step < STEPS:
        model.train_on_batch(x, y)
        state.step += 1
        if WORLD == 0 and hvd.rank() == 1 and state.step == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        state.commit()


def check():
    train(state)
    assert (WORLD, hvd.size(), state.step) == (1, 1, STEPS), (WORLD, hvd.size(), state.step)
    np.testing.assert_allclose(model.layers[0].get_weights()[0], reference(), rtol=1e-5,
                               atol=1e-6)


report.case("elastic_reset_in_jit", check)
report.write()
hvd.shutdown()
