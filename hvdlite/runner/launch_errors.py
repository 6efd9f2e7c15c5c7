"""The launcher's errors: a problem that stops a job from starting (exit status 1), or a mistake
on the command line (exit status 2, like argparse's)."""
from __future__ import annotations


class LaunchError(Exception):
    """A problem that stops the job from starting; the message is shown to the user."""

    exit_status = 1


class UsageError(LaunchError):
    """A mistake on the command line (exit status 2, like argparse's errors)."""

    exit_status = 2
