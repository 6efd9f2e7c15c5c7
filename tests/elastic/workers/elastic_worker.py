"""An elastic PyTorch job that fails, or changes its hosts, where the test's plan says, and logs
what happened for tests/multihost/test_elastic.py to check.

The model is linear and the targets an exact linear function of the inputs, so every run
converges to the same weights whatever its sizes were; a run whose sizes never change must
end with exactly the weights of a run without failures.  Every step, the ranks allgather the
indices they trained on and append them to the state's ``seen`` list, so the committed state
carries the history of samples that made it into the model.

Environment:
  ELASTIC_LOG    directory for the JSON-lines logs (one file per world and rank)
  ELASTIC_PLAN   JSON list of events {"world", "step" (optimizer steps done in this world),
                 "rank" (or "all"), "action", ...}; actions:
                   sigkill       SIGKILL itself after the step, before its commit
                   exit          os._exit(3) there
                   commit_kill   SIGKILL itself inside the commit (after saving, before the
                                 commit's collective check)
                   pause         sleep "pause" seconds there (hold a world for the driver)
                   discover      rank "writer" (default 0) writes "hosts" to ELASTIC_DISCOVERY,
                                 and the event's ranks pause "pause" seconds (the driver
                                 notices meanwhile)
                   remove_host   write "hosts" to ELASTIC_DISCOVERY, then kill every process
                                 of this rank's (simulated) host
  ELASTIC_EPOCHS number of epochs (default 3)
  ELASTIC_POWERSGD  "1": the optimizer compresses with PowerSGD (rank 1, 2 plain steps; its Q
                 and error feedback start over in every world)
"""
import hashlib
import json
import os
import signal
import socket
import time

T_PROCESS = time.time()

import torch  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402

T_IMPORTED = time.time()
N, FEATURES, OUTPUTS, BATCH = 240, 12, 3, 4
WORLD = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))
PLAN = json.loads(os.environ.get("ELASTIC_PLAN", "[]"))
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
LOG_DIR = os.environ["ELASTIC_LOG"]

hvd.init()
T_INIT = time.time()
RANK, SIZE = hvd.rank(), hvd.size()
LOG = open(os.path.join(LOG_DIR, f"w{WORLD}.r{RANK}.jsonl"), "a", buffering=1)


def log(event: str, **fields) -> None:
    LOG.write(json.dumps({"ev": event, "world": WORLD, "rank": RANK, "size": SIZE,
                          "t": time.time(), **fields}) + "\n")


def events(step: int) -> list[dict]:
    return [e for e in PLAN if e["world"] == WORLD and e["step"] == step
            and e["rank"] in (RANK, "all")]


generator = torch.Generator().manual_seed(1234)
X = torch.randn(N, FEATURES, generator=generator)
TRUE_W = torch.randn(FEATURES, OUTPUTS, generator=generator)
Y = X @ TRUE_W
torch.manual_seed(99)
model = torch.nn.Linear(FEATURES, OUTPUTS, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(),
    compression=(hvd.Compression.powersgd(rank=1, start_iter=2)
                 if os.environ.get("ELASTIC_POWERSGD") == "1" else hvd.Compression.none))
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=7)
kill_in_commit = False


def checksum() -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    for group in optimizer.state_dict()["state"].values():
        for value in group.values():
            if isinstance(value, torch.Tensor):
                digest.update(value.numpy().tobytes())
    return digest.hexdigest()[:16]


class LoggedState(hvd.elastic.TorchState):
    def save(self):
        super().save()
        log("saved", step=self.step, epoch=self.epoch, checksum=checksum())
        if kill_in_commit:
            log("act", action="commit_kill", step=self.step)
            os.kill(os.getpid(), signal.SIGKILL)


state = LoggedState(model, optimizer, sampler=sampler, epoch=0, step=0, seen=[])
log("start", host=socket.gethostname(), pid=os.getpid(), t_process=T_PROCESS,
    t_imported=T_IMPORTED, t_init=T_INIT,   # (its own t: the script's setup is done)
    warm=os.environ.get("HVDLITE_ELASTIC_WARM_CHILD") == "1")   # forked by the warm process


@hvd.elastic.run
def train(state):
    global kill_in_commit
    log("synced", step=state.step, epoch=state.epoch, processed=sampler.processed_num,
        checksum=checksum(), seen=len(state.seen))
    local_steps = 0
    while state.epoch < EPOCHS:
        indices = list(sampler)
        for start in range(0, len(indices), BATCH):
            batch = indices[start:start + BATCH]
            optimizer.zero_grad()
            loss = ((model(X[batch]) - Y[batch]) ** 2).mean()
            loss.backward()
            optimizer.step()
            everyone = hvd.allgather_object(batch, name="batch")
            state.seen = state.seen + [(state.epoch, [i for b in everyone for i in b])]
            state.step += 1
            sampler.record_batch(start // BATCH, BATCH)
            local_steps += 1
            if local_steps == 1:
                log("first_step", step=state.step)
            for event in events(local_steps):
                action = event["action"]
                log("act", action=action, step=state.step)
                if action == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif action == "exit":
                    os._exit(3)
                elif action == "pause":
                    time.sleep(event["pause"])
                elif action == "commit_kill":
                    kill_in_commit = True
                elif action == "discover":
                    if RANK == event.get("writer", 0):
                        with open(os.environ["ELASTIC_DISCOVERY"], "w") as f:
                            f.write(event["hosts"])
                    time.sleep(event.get("pause", 0))
                elif action == "remove_host":
                    with open(os.environ["ELASTIC_DISCOVERY"], "w") as f:
                        f.write(event["hosts"])
                    LOG.flush()
                    os.kill(-1, signal.SIGKILL)   # every process of this host's PID namespace
                    os.kill(os.getpid(), signal.SIGKILL)
            state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()
    return checksum()


final = train(state)
reducer_state = getattr(optimizer._reducer, "state", None)   # (PowerSGD's, if compressing)
log("done", step=state.step, checksum=final, seen=state.seen,
    powersgd_steps=None if reducer_state is None else reducer_state.counter.steps,
    weights=model.weight.detach().reshape(-1).tolist(),
    loss=((model(X) - Y) ** 2).mean().item())
hvd.shutdown()
