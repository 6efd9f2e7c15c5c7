"""Calls hvdlite.run() as a notebook would (tests/launcher/test_run_func.py); prints one JSON line
``RESULT {...}`` with what came back.  The ranks' output is captured through sys.stdout and
sys.stderr replaced by in-memory streams, as in a notebook."""
import io
import json
import sys
import threading

import numpy as np

import hvdlite


def report(**fields):
    print("RESULT " + json.dumps(fields), file=sys.__stdout__, flush=True)


def outcome(call):
    """Run ``call``; the fields describing what happened."""
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    try:
        value, error = call(), None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        value, error = None, exc
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    fields = {"value": value, "stdout": out.getvalue(), "stderr": err.getvalue()}
    if error is not None:
        cause = error.__cause__
        fields.update(error=type(error).__name__, message=str(error),
                      cause=None if cause is None else [type(cause).__name__, str(cause)])
    return fields


def collectives(scale, offset=0):
    import hvdlite as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print(f"hello from rank {rank}", flush=True)
    summed = hvd.allreduce(np.arange(4, dtype=np.int64) * (rank + 1) * scale, op=hvd.Sum)
    gathered = hvd.allgather(np.full(rank + 1, rank, dtype=np.int32))
    return [rank, size, summed.tolist(), gathered.tolist(), offset]


def where(scale):
    """Where the rank ran (tests/multihost): its place in the job, its host, and an allreduce."""
    import socket
    import hvdlite as hvd
    hvd.init()
    summed = hvd.allreduce(np.arange(3, dtype=np.int64) * (hvd.rank() + 1) * scale, op=hvd.Sum)
    return [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size(), socket.gethostname(), summed.tolist()]


def where_and_how(scale):
    """:func:`where`, and the variables that ``network_interface`` sets for the rank."""
    import os
    return where(scale) + [os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("FI_TCP_IFACE")]


def raise_on_last_rank():
    """The last rank raises before a collective that the others then wait in."""
    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == hvd.size() - 1:
        raise KeyError("missing shard on the last rank")
    hvd.allreduce(np.ones(3), name="never.completes")


def unpicklable_result():
    return threading.Lock()


def exit_early():
    import os
    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1:
        # Leave only after rank 0 is done: its shutdown ends this wait (an allreduce rank 0
        # never submits).  MPICH's launcher kills every other rank as soon as one exits without
        # finalizing MPI, so leaving at once could take rank 0 down before it reported back
        # (seen: about one run in twelve).
        try:
            hvd.allreduce(np.zeros(1), name="exit_early.until_rank0_is_done")
        except hvdlite.HvdliteError:
            pass
        sys.stdout.flush()
        os._exit(0)
    return hvd.rank()


def elastic_training(fail_in_world0):
    """An elastic job whose rank 1 exits with status 3 in its first world: the next world
    (without that rank's host) resumes from the last commit and its return values come back."""
    import os
    import hvdlite.torch as hvd
    import torch
    hvd.init()
    world = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)

    @hvd.elastic.run
    def train(state):
        resumed = state.step
        while state.step < 10:
            optimizer.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            state.step += 1
            if fail_in_world0 and world == 0 and state.step == 4 and hvd.rank() == 1:
                os._exit(3)
            state.commit()
        return resumed

    resumed = train(state)
    return [world, hvd.rank(), hvd.size(), resumed, state.step]


MODES = {
    "collectives": lambda np_: hvdlite.run(collectives, args=(3,), kwargs={"offset": 7},
                                           num_proc=np_),
    "lambda_np_alias": lambda np_: hvdlite.run(lambda k: k * 2, args=(21,), np=np_),
    "raises": lambda np_: hvdlite.run(raise_on_last_rank, num_proc=np_),
    "unpicklable_result": lambda np_: hvdlite.run(unpicklable_result, num_proc=np_),
    "exit_early": lambda np_: hvdlite.run(exit_early, num_proc=np_),
    "use_gloo": lambda np_: hvdlite.run(len, num_proc=np_, use_gloo=True),
    "elastic_without_hosts": lambda np_: hvdlite.run(len, num_proc=np_, min_num_proc=1),
    "elastic": lambda np_: hvdlite.run(elastic_training, args=(True,), num_proc=np_,
                                       min_num_proc=1, hosts="localhost:1,127.0.0.1:1"),
    # a job on this host only: the launcher starts its ranks without ssh, whatever its options
    "ssh_port": lambda np_: hvdlite.run(lambda: "no ssh needed", num_proc=np_, ssh_port=2222,
                                        ssh_identity_file=__file__),
    "hosts_and_hostfile": lambda np_: hvdlite.run(len, hosts="a:1", hostfile="f"),
    "not_callable": lambda np_: hvdlite.run("train.py", num_proc=np_),
    # argv[3]: the hosts, e.g. "node1:2,node2:2"
    "on_hosts": lambda np_: hvdlite.run(where, args=(5,), num_proc=np_, hosts=sys.argv[3]),
    # argv[3:7]: hosts, ssh port, identity file, network interface
    "on_hosts_ssh": lambda np_: hvdlite.run(
        where_and_how, args=(5,), num_proc=np_, hosts=sys.argv[3], ssh_port=int(sys.argv[4]),
        ssh_identity_file=sys.argv[5], network_interface=sys.argv[6]),
}

if __name__ == "__main__":
    mode, np_ = sys.argv[1], int(sys.argv[2])
    report(**outcome(lambda: MODES[mode](np_)))
