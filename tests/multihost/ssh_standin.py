"""An ``ssh`` stand-in that "logs in" to a simulated host of the bed (see hosts.py).

Called as ssh is (``STANDIN [options] [user@]HOST command...``: MPICH's Hydra runs
``STANDIN -x HOST "/path/hydra_pmi_proxy" --control-port ...``), it runs the command the way
sshd would: joined with spaces and handed to ``/bin/sh -c``, in the home directory, with a
fresh login environment (not the caller's: whatever the ranks need must be forwarded by the
launcher, as on a real cluster), inside the host's namespaces (``nsenter``).  Every call is
appended to ``standin.log`` in the bed's directory as one JSON line, so tests can see what the
launcher passed.  The hosts accept logins on one port only (the bed's ``ssh_port`` file, 22
unless a test sets another): a wrong ``-p`` fails as an unreachable port would, and an unknown
host as ssh does, with a message on stderr and exit status 255.  A host can be told to refuse
logins (``refuse/HOST`` in the bed's directory holds the message to fail with, as a host whose
sshd rejects the key would).

argv[1] is the bed's directory (the generated wrapper script passes it); the rest is ssh's.
"""
import json
import os
import pwd
import sys

FLAGS = set("46AaCfGgKkMNnqsTtVvXxYy")
WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def parse(args: list[str]) -> tuple[dict[str, list[str]], str | None, list[str]]:
    """(options: letter -> values, destination, command words), as ssh's getopt reads them."""
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and len(args[i]) > 1:
        word = args[i]
        i += 1
        if word == "--":
            break
        for pos, letter in enumerate(word[1:], start=1):
            if letter in WITH_VALUE:
                value = word[pos + 1:]
                if not value:
                    if i >= len(args):
                        raise SystemExit(f"ssh: option requires an argument -- {letter}")
                    value, i = args[i], i + 1
                options.setdefault(letter, []).append(value)
                break
            if letter not in FLAGS:
                raise SystemExit(f"ssh: illegal option -- {letter}")
            options.setdefault(letter, []).append("")
    destination = args[i] if i < len(args) else None
    return options, destination, args[i + 1:]


def fail(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(255)


def main() -> None:
    bed, args = sys.argv[1], sys.argv[2:]
    with open(os.path.join(bed, "standin.log"), "a") as log:
        log.write(json.dumps({"argv": args}) + "\n")
    try:
        options, destination, command = parse(args)
    except SystemExit as exc:
        fail(str(exc))
    if destination is None:
        fail("usage: ssh [options] destination [command]")
    host = destination.rpartition("@")[2]
    port = options.get("p", ["22"])[-1]
    try:
        with open(os.path.join(bed, "hosts", host)) as f:
            pid = int(f.read())
    except (OSError, ValueError):
        fail(f"ssh: Could not resolve hostname {host}: Name or service not known")
    with open(os.path.join(bed, "ssh_port")) as f:
        listening = f.read().strip()
    if port != listening:
        fail(f"ssh: connect to host {host} port {port}: Connection refused")
    try:
        with open(os.path.join(bed, "refuse", host)) as f:
            fail(f.read().strip())
    except FileNotFoundError:
        pass
    if not command:
        fail("ssh stand-in: interactive logins are not supported; give a command")
    user = pwd.getpwuid(os.getuid())
    home = user.pw_dir if os.path.isdir(user.pw_dir) else "/"
    env = {"HOME": home, "USER": user.pw_name, "LOGNAME": user.pw_name, "SHELL": "/bin/sh",
           "PATH": LOGIN_PATH}
    os.execvpe("nsenter", ["nsenter", f"--target={pid}", "--uts", "--ipc", "--pid", "--mount",
                           f"--wd={home}", "--", "/bin/sh", "-c", " ".join(command)], env)


if __name__ == "__main__":
    main()
