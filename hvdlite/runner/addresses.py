"""Which address a process that workers call back (``hvdlite.run``'s driver, the elastic
driver) listens on, and the address the workers are told."""
from __future__ import annotations

import socket

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_local(name: str) -> bool:
    if name in _LOCAL_NAMES or name in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


def listen_address(hosts) -> tuple[str, str]:
    """(address to bind, address the ranks connect to) for the driver's listener, for a job
    on ``hosts`` (None: this host)."""
    remote = [host.name for host in hosts or () if not is_local(host.name)]
    if not remote:
        return "127.0.0.1", "127.0.0.1"
    # The local address on the route to a remote host (a UDP connect sends nothing).  A name
    # that does not resolve is passed over: the launcher's host check names it.
    for name in remote:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((name, 9))
            except OSError:
                continue
            return "0.0.0.0", probe.getsockname()[0]
    return "0.0.0.0", socket.gethostname()
