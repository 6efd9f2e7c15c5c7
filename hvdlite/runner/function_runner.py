"""``hvdlite.run(func, ...)``: Horovod's ``horovod.run``, the launcher as a Python call.

Runs ``func(*args, **kwargs)`` on every rank of a new job (started exactly as ``hvdlite run``
starts one, with the same options and refusals) and returns the ranks' return values, in rank
order.  Made for notebooks and driver scripts: ``func`` may be a lambda or a function defined in
``__main__`` (it travels by value, through cloudpickle, as in Horovod).

How the function and the results travel: this process listens on a TCP port
(``multiprocessing.connection``, authenticated with a random key) and every rank, started as
``python -m hvdlite.runner.task``, fetches the pickled function from there and sends back its
result or its exception.  The port and the key reach the ranks through their environment, never
on a command line.  For a job on other hosts, this host must be reachable from them (the
address used is the one on the route to the first remote host).
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
import warnings
from typing import Any, Callable, Sequence

from . import elastic, launch
from .addresses import listen_address as _listen_address

ADDRESS_VARIABLE = "HVDLITE_RUN_ADDRESS"   # "host:port" of the driver's listener
KEY_VARIABLE = "HVDLITE_RUN_KEY"           # its authentication key, hex


def cloudpickle_module():
    try:
        import cloudpickle
    except ImportError:
        raise ImportError("hvdlite.run() needs cloudpickle to send the function to the ranks: "
                          "pip install cloudpickle") from None
    return cloudpickle


def _launcher_argv(num_proc, min_num_proc, max_num_proc, slots, reset_limit, cooldown_range,
                   hosts, hostfile, start_timeout, ssh_port, ssh_identity_file, disable_cache,
                   output_filename, verbose, use_gloo, use_mpi, mpi_args, network_interface,
                   executable) -> list[str]:
    """The ``hvdlite run`` command line for these arguments (so the CLI's checks, defaults and
    refusals apply unchanged).  Pure logic, unit-tested."""
    argv = ["-np", str(num_proc)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile),
                        ("--min-np", min_num_proc), ("--max-np", max_num_proc),
                        ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                        ("--start-timeout", start_timeout), ("-p", ssh_port),
                        ("-i", ssh_identity_file), ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            argv += [flag, str(value)]
    if cooldown_range is not None:
        argv += ["--blacklist-cooldown-range", *(str(v) for v in cooldown_range)]
    for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose),
                     ("--gloo", use_gloo), ("--mpi", use_mpi)):
        if on:
            argv.append(flag)
    if mpi_args:
        argv.append(f"--mpi-args={mpi_args}")
    return argv + [executable or sys.executable, "-m", "hvdlite.runner.task"]


def _parse(argv: Sequence[str]):
    """``launch.parse_args`` raising ValueError with argparse's message instead of exiting."""
    parser = launch.build_parser()

    def error(message: str):
        raise ValueError(f"hvdlite.run(): {message}")

    parser.error = error   # argparse (and the horovodrun refusals) report through this
    return launch.parse_args(argv, parser)


class FunctionDriver:
    """Serves the pickled function to the ranks and collects what they send back.

    A connection carries any number of requests: ``("payload", rank)`` (answered with the
    payload's bytes), ``("result", rank, succeeded, data, world)`` (answered ``"ok"``), and the
    kinds in ``handlers`` (``kind -> callable(*rest)``, not answered): e.g. the Spark runner's
    tasks report their start and relay their rank's output over one connection each."""

    def __init__(self, payload: bytes, bind: str,
                 handlers: dict[str, Callable[..., None]] | None = None) -> None:
        from multiprocessing.connection import Listener
        self.key = secrets.token_bytes(32)
        self.payload = payload
        self.handlers = dict(handlers or {})
        # (world, rank) -> (succeeded, data); an elastic job runs a world after each reset
        self.results: dict[tuple[int, int], tuple[bool, Any]] = {}
        self._listener = Listener((bind, 0), authkey=self.key)
        self.port = self._listener.address[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="hvdlite-run-driver",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from multiprocessing import AuthenticationError
        while True:
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue   # a stranger or a dropped connection: keep serving the ranks
            except OSError:
                return
            if self._stop:
                conn.close()
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        with conn:
            try:
                while True:
                    request = conn.recv()
                    if request[0] == "payload":
                        conn.send_bytes(self.payload)
                    elif request[0] == "result":
                        _, rank, succeeded, data, world = request
                        self.results[(world, rank)] = (succeeded, data)
                        conn.send("ok")
                    elif request[0] in self.handlers:
                        self.handlers[request[0]](*request[1:])
            except (EOFError, OSError):
                pass   # the end of the connection (a rank that died: its result is missing)

    def close(self) -> None:
        from multiprocessing.connection import Client
        self._stop = True
        try:   # wake the accept() so the thread sees the stop
            Client(("127.0.0.1" if self._listener.address[0] == "0.0.0.0"
                    else self._listener.address[0], self.port), authkey=self.key).close()
        except OSError:
            pass
        self._thread.join(5)
        self._listener.close()


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None,
        num_proc: int = 1, min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None,
        verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, executable: str | None = None,
        np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks and return their return values, the
    value of rank ``r`` at index ``r`` (Horovod's ``horovod.run``).

    ``func`` usually calls ``hvd.init()`` itself and trains; it travels by value, so lambdas,
    closures and functions defined in a notebook work (whatever they refer to must be
    picklable, and modules they import must be importable on the ranks).  The other arguments
    are those of ``hvdlite run``: ``hosts="h1:2,h2:2"`` or ``hostfile``, ``ssh_port`` and
    ``ssh_identity_file`` (``-p``/``-i``), ``start_timeout`` (for the check that every remote
    host can be reached), ``mpi_args``, ``network_interface``, ``output_filename``,
    ``verbose``; ``executable`` is the Python the ranks run (default: this one).  ``np``,
    ``min_np`` and ``max_np`` are Horovod's deprecated spellings.  ``use_gloo`` raises
    ``ValueError`` saying why and what to use instead, as the launcher does; a remote host that
    cannot be reached raises ``RuntimeError`` naming it.

    Elastic jobs (docs/elastic.md): ``min_num_proc``, ``max_num_proc``, ``slots``,
    ``reset_limit``, ``cooldown_range`` are ``hvdlite run``'s ``--min-np``, ``--max-np``,
    ``--slots-per-host``, ``--reset-limit`` and ``--blacklist-cooldown-range``, with ``hosts``
    or ``hostfile`` as the pool (``num_proc`` below ``min_num_proc`` is raised to it).  ``func``
    then wraps its training in ``hvd.elastic.run``; the return values are those of the last
    world (its size may differ from ``num_proc``).

    The ranks' output is copied to this process's ``sys.stdout``/``sys.stderr`` (so it shows
    in a notebook).  If ``func`` raises on some rank, or a rank exits without returning, this
    raises ``RuntimeError`` naming the ranks, with the traceback of the first rank that failed
    on its own (not with ``RankExitedError`` because a peer left), and that rank's exception
    (when it can be unpickled here) as the cause.
    """
    if np is not None:
        if num_proc == 1:
            num_proc = np
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, 2)
    if min_np is not None:
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, 2)
    if max_np is not None:
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, 2)
    if not callable(func):
        raise TypeError(f"hvdlite.run(): func must be callable, got {type(func).__name__}.")
    if min_num_proc is not None and num_proc < min_num_proc:
        num_proc = min_num_proc
    if hosts is not None and hostfile is not None:
        raise ValueError("hvdlite.run(): give hosts or hostfile, not both.")
    parsed = _parse(_launcher_argv(
        num_proc, min_num_proc, max_num_proc, slots, reset_limit, cooldown_range, hosts,
        hostfile, start_timeout, ssh_port, ssh_identity_file, disable_cache, output_filename,
        verbose, use_gloo, use_mpi, mpi_args, network_interface, executable))
    try:
        hosts, _ = launch.resolve_hosts(parsed)
        if elastic.requested(parsed):
            elastic.settings_from_args(parsed, os.environ)
        else:
            launch.process_count(parsed, hosts)
    except launch.LaunchError as exc:
        raise ValueError(f"hvdlite.run(): {exc}") from None
    payload = cloudpickle_module().dumps((func, tuple(args), dict(kwargs or {})))
    bind, advertised = _listen_address(hosts)
    if elastic.requested(parsed) and parsed.host_discovery_script:
        bind = "0.0.0.0"   # the hosts are not known yet
    driver = FunctionDriver(payload, bind)
    environ = dict(os.environ)
    environ[ADDRESS_VARIABLE] = f"{advertised}:{driver.port}"
    environ[KEY_VARIABLE] = driver.key.hex()
    worlds: list[tuple[int, int]] = []   # (index, size) of each world started
    try:
        status = launch.launch(parsed, environ, forward=(ADDRESS_VARIABLE, KEY_VARIABLE),
                               output=(sys.stdout, sys.stderr),
                               on_world=lambda index, size: worlds.append((index, size)))
    except launch.LaunchError as exc:
        raise RuntimeError(f"hvdlite.run(): {exc}") from None
    finally:
        driver.close()
    world, size = worlds[-1] if worlds else (0, 0)
    return collect_results({rank: result for (w, rank), result in driver.results.items()
                     if w == world}, size, status)


def collect_results(results: dict[int, tuple[bool, Any]], size: int, status: int,
                    caller: str = "hvdlite.run()") -> list[Any]:
    """The return values in rank order, or RuntimeError describing what went wrong.
    ``results``: rank -> (succeeded, data) as the ranks reported them; ``status``: the job's
    exit status; ``caller`` starts the message."""
    failed = sorted(rank for rank, (ok, _) in results.items() if not ok)
    missing = [rank for rank in range(size) if rank not in results]
    if not failed and not missing and status == 0:
        cloudpickle = cloudpickle_module()
        return [cloudpickle.loads(results[rank][1]) for rank in range(size)]
    lines = [f"{caller}: the job failed (exit status {status})." if status else
             f"{caller}: the job exited with status 0, but not every rank reported back."]
    cause = None
    if failed:
        errors = {rank: unpickled_exception(results[rank][1][1]) for rank in failed}
        # A rank that failed only because another one did (RankExitedError) is not the story.
        from hvdlite.common.core import RankExitedError
        first = next((rank for rank in failed if not isinstance(errors[rank], RankExitedError)),
                     failed[0])
        lines.append(f"func raised on rank(s) {failed}; rank {first}'s traceback:\n"
                     f"{results[first][1][0].rstrip()}")
        cause = errors[first]
    if missing:
        lines.append(f"rank(s) {missing} returned nothing (they exited early, were killed, or "
                     f"never started); their output above says why.")
    raise RuntimeError("\n".join(lines)) from cause


def unpickled_exception(pickled: bytes | None) -> BaseException | None:
    """A rank's exception, or None when it did not pickle or does not unpickle here."""
    if pickled is None:
        return None
    try:
        return cloudpickle_module().loads(pickled)
    except Exception:  # noqa: BLE001 - the traceback text still tells the story
        return None
