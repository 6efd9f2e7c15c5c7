"""An elastic PyTorch job whose ranks write all the time (issue 54): a tqdm progress bar on
stderr from the main thread, a `logging` line every 20 ms from another thread, and `print` in
`finally`; a DataLoader with two worker processes feeds it.  In world 0, rank 1 SIGKILLs itself
mid-epoch, and each survivor kills its own host's MPI proxy (the world's launcher does that
when it tears the world down, which can happen before the survivor notices the failure), then
writes a second later (and, with CHATTY_RAISE=1, raises an error of its own there); with
CHATTY_LOSE_HOST=1 rank 1 takes every process of its (simulated) host down with it, as a lost
host would.  The survivors must go on writing, reset, and finish.  Each rank of the last world
prints ``finished world W rank R of N epoch E``."""
import logging
import os
import signal
import sys
import threading
import time

import torch
import tqdm
from torch.utils.data import DataLoader, TensorDataset

import hvdlite.torch as hvd

if os.environ.get("CHATTY_IMPORT"):   # a library the warm process preloads too
    __import__(os.environ["CHATTY_IMPORT"])
hvd.init()
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format=f"log rank {hvd.rank()}: %(message)s")
WORLD = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))
stop = threading.Event()


def end_my_proxy():
    """Kill this host's MPI proxy (the shield's parent), which holds the other end of this
    rank's stdout and stderr, as the world's launcher does when it tears the world down."""
    shield = os.environ.get("HVDLITE_ELASTIC_SHIELD")
    try:
        with open(f"/proc/{shield}/stat") as f:
            proxy = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(proxy, signal.SIGKILL)
    except (OSError, ValueError, TypeError, IndexError):
        pass   # the launcher was quicker


def chatter():
    n = 0
    while not stop.is_set():
        logging.info("still here %d", n)
        n += 1
        time.sleep(0.02)


threading.Thread(target=chatter, daemon=True).start()
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)


@hvd.elastic.run
def train(state):
    loader = DataLoader(data, batch_size=4, num_workers=2)
    while state.epoch < 3:
        try:
            for i, (x, y) in enumerate(tqdm.tqdm(loader, desc=f"epoch {state.epoch}",
                                                 file=sys.stderr, mininterval=0)):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                state.batch += 1
                if i % 4 == 0:
                    state.commit()
                if WORLD == 0 and hvd.rank() == 1 and state.epoch == 1 and i == 8:
                    if os.environ.get("CHATTY_LOSE_HOST"):   # every process of this host:
                        os.kill(-1, signal.SIGKILL)          # its proxy, shield, warm process
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)
        finally:
            if sys.exc_info()[0] is not None:   # the world failed: as its launcher tears it
                end_my_proxy()                  # down, which it may do before this rank
                time.sleep(1.0)                 # notices, then write a second later
            print(f"world {WORLD} rank {hvd.rank()} leaves epoch {state.epoch}", flush=True)
            if sys.exc_info()[0] is not None and os.environ.get("CHATTY_RAISE"):
                raise RuntimeError("the script's own error, raised after the world failed")
        state.epoch += 1
        state.commit()


train(state)
stop.set()
print(f"finished world {WORLD} rank {hvd.rank()} of {hvd.size()} epoch {state.epoch} "
      f"warm {os.environ.get('HVDLITE_ELASTIC_WARM_CHILD') == '1'}", flush=True)
