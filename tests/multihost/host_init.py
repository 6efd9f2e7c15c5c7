"""The first process of one simulated host (run by ``unshare``; see hosts.py).

Inside fresh UTS, IPC, PID and mount namespaces it names the host, gives it a private ``/dev/shm``
and ``/tmp`` (tmpfs), keeps the listed directories under ``/tmp`` visible at the same paths (the
bed's shared directory, and the checkout or Python if they live under ``/tmp``), binds the bed's
hosts file over ``/etc/hosts`` (in this mount namespace only), prints ``ready`` and then reaps
children for ever: as process 1 of its PID namespace it inherits every orphan of the host.

argv: host name, hosts file, directories to keep.
"""
import os
import signal
import socket
import subprocess
import sys

STAGE = "/dev/shm/.host-init-old-tmp"


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, stdin=subprocess.DEVNULL)


def setup(name: str, hosts_file: str, keep: list[str]) -> None:
    socket.sethostname(name)
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")
    if keep:   # the real /tmp stays reachable through a staging bind until the keeps are bound
        os.mkdir(STAGE)
        mount("--bind", "/tmp", STAGE)
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")
    for path in keep:
        os.makedirs(path, exist_ok=True)
        mount("--bind", os.path.join(STAGE, os.path.relpath(path, "/tmp")), path)
    if keep:
        subprocess.run(["umount", "-l", STAGE], check=True)
        os.rmdir(STAGE)
    mount("--bind", hosts_file, "/etc/hosts")


def reap_forever() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        signal.sigwait({signal.SIGCHLD})


def main() -> None:
    name, hosts_file, keep = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        setup(name, hosts_file, keep)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"host {name}: setup failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    print("ready", flush=True)
    sys.stdout.close()
    os.close(1)
    reap_forever()


if __name__ == "__main__":
    main()
