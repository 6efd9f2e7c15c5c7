"""One rank of an :func:`hvdlite.run` job: ``python -m hvdlite.runner.task``.

Fetches the pickled ``(func, args, kwargs)`` from the driver named by the environment, runs it,
and sends back the return value, or the exception and its traceback (then exits with status 1,
so the launcher reports the failure too).
"""
from __future__ import annotations

import os
import sys
import traceback

from .function_runner import ADDRESS_VARIABLE, KEY_VARIABLE, cloudpickle_module
from .rank_output import launcher_rank


def _exchange(address: tuple[str, int], key: bytes, message):
    from multiprocessing.connection import Client
    with Client(address, authkey=key) as conn:
        conn.send(message)
        return conn.recv_bytes() if message[0] == "payload" else conn.recv()


def _failure(exc: BaseException) -> tuple[str, bytes | None]:
    """The traceback text and, if it pickles, the exception itself."""
    text = traceback.format_exc()
    try:
        return text, cloudpickle_module().dumps(exc)
    except Exception:  # noqa: BLE001 - the traceback carries the message anyway
        return text, None


def main() -> int:
    try:
        host, _, port = os.environ[ADDRESS_VARIABLE].rpartition(":")
        key = bytes.fromhex(os.environ.pop(KEY_VARIABLE))   # not for func or its children
    except (KeyError, ValueError):
        print(f"hvdlite.runner.task runs the ranks of hvdlite.run(); it needs "
              f"{ADDRESS_VARIABLE} and {KEY_VARIABLE} from it.", file=sys.stderr)
        return 2
    address = (host, int(port))
    rank = launcher_rank(os.environ)
    cloudpickle = cloudpickle_module()
    func, args, kwargs = cloudpickle.loads(_exchange(address, key, ("payload", rank)))
    try:
        value = func(*args, **kwargs)
        try:
            report = (True, cloudpickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - reported as this rank's failure
            raise TypeError(f"the return value of func on rank {rank} cannot be pickled "
                            f"({type(value).__name__}): {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
        report = (False, _failure(exc))
        traceback.print_exc()
    world = int(os.environ.get("HVDLITE_ELASTIC_WORLD", "0"))   # elastic jobs: see hvdlite.run
    _exchange(address, key, ("result", rank, *report, world))
    return 0 if report[0] else 1


if __name__ == "__main__":
    sys.exit(main())
