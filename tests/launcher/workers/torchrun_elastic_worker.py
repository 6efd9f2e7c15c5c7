"""An ``hvd.elastic.run`` training loop under torchrun (issue 48): in the first attempt rank 1
dies right after the commit of epoch 5; torchrun (``--max-restarts 1``) starts every worker
again, and the second attempt must resume from the newest commit kept in torchrun's store,
with the state as committed and the reset callbacks run.  Prints one line per rank."""
import os
import time

import torch

import hvdlite.torch as hvd

hvd.init()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
state = hvd.elastic.TorchState(epoch=0, total=0.0)
resets = []
state.register_reset_callbacks([lambda: resets.append(1)])


@hvd.elastic.run
def train(state):
    started = state.epoch
    while state.epoch < 8:
        got = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="step")
        state.total += float(got[0])
        state.epoch += 1
        state.commit()
        time.sleep(0.2)
        if attempt == "0" and hvd.rank() == 1 and state.epoch == 5:
            os._exit(9)
    return started


started = train(state)
print(f"attempt {attempt} rank {hvd.rank()} resumed at {started} epoch {state.epoch} "
      f"total {state.total:g} resets {len(resets)}", flush=True)
