#!/usr/bin/env python3
"""What plain TCP reaches on the capped loopback link: the reference beside the link floor.

The cross-host benchmarks (``cross_host_benchmark.py --link``, ``compression_benchmark.py
--link``) print each result against its *link floor*, the bytes that must cross over the capped
rate.  A token bucket on ``lo`` and TCP together do not quite reach that rate, so this script
measures the best any transport can do there: for an allreduce of S bytes across 2 hosts (which
moves 2 S over the one shared link), four TCP flows (two each way, as the two pairs of ranks of
a 2 + 2 hierarchical allreduce) carry S / 2 bytes each between two simulated hosts' loopback
addresses, all at once, under the cap (``tests/multihost/link.py``; removed on any exit).  It
prints each size's times against the floor.  No namespaces are needed, but the cap needs root.

    sudo .venv/bin/python benchmarks/link_reference.py --link 10gbit
    sudo .venv/bin/python benchmarks/link_reference.py --link 1gbit --sizes 16MiB --repeat 3
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.multihost import link  # noqa: E402

HOSTS = ("127.0.2.1", "127.0.2.2")   # two simulated hosts' addresses (loopback only)
FLOWS = ((0, 1), (1, 0), (0, 1), (1, 0))   # (sender, receiver) host indices


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", required=True, help="rate to cap lo at (tc's notation: 10gbit)")
    p.add_argument("--sizes", default="16MiB,32MiB,64MiB", help="allreduce sizes S")
    p.add_argument("--repeat", type=int, default=5, help="transfers per size")
    args = p.parse_args(argv)
    try:
        args.rate = link.parse_rate(args.link)
    except ValueError as exc:
        p.error(f"--link: {exc}")
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    return args


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[:-len(unit)]) * factor
    return int(text)


def transfer(nbytes_per_flow: int) -> float:
    """Seconds for the four flows to deliver ``nbytes_per_flow`` each, all at once."""
    payload = bytes(nbytes_per_flow)
    receivers, senders = [], []
    for sender, receiver in FLOWS:
        server = socket.create_server((HOSTS[receiver], 0))
        client = socket.create_connection(server.getsockname(),
                                          source_address=(HOSTS[sender], 0))
        conn, _ = server.accept()
        server.close()
        receivers.append(threading.Thread(target=drain, args=(conn, nbytes_per_flow)))
        senders.append(threading.Thread(target=send, args=(client, payload)))
    start = time.perf_counter()
    for thread in receivers + senders:
        thread.start()
    for thread in receivers + senders:
        thread.join()
    return time.perf_counter() - start


def send(sock: socket.socket, payload: bytes) -> None:
    with sock:
        sock.sendall(payload)


def drain(sock: socket.socket, nbytes: int) -> None:
    buf = bytearray(1 << 20)
    with sock:
        got = 0
        while got < nbytes:
            n = sock.recv_into(buf)
            if n == 0:
                raise RuntimeError(f"a flow ended after {got} of {nbytes} bytes")
            got += n


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = link.unavailable_reason()
    if reason:
        print(f"link_reference: {reason}", file=sys.stderr)
        return 2
    print(f"lo capped at {link.format_rate(args.rate)}; 4 TCP flows (2 each way) carrying 2 S "
          f"in all; floor = 2 S / rate; {args.repeat} transfers per size")
    with link.LinkCap(args.link):
        for size in args.sizes:
            times = [1e3 * transfer(size // 2) for _ in range(args.repeat)]
            floor = link.floor_ms(2 * size, args.rate)
            print(f"S = {size / (1 << 20):g} MiB: median {statistics.median(times):.1f} ms "
                  f"({statistics.median(times) / floor:.2f}x the floor), best {min(times):.1f} "
                  f"ms ({min(times) / floor:.2f}x); floor {floor:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
