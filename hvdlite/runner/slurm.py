"""The hosts of a SLURM allocation, for ``hvdlite run`` inside ``sbatch`` or ``salloc``.

Inside an allocation SLURM names its nodes in ``SLURM_JOB_NODELIST`` (a compressed host list,
``node[01-03,07],gpu5``) and how many tasks each runs in ``SLURM_TASKS_PER_NODE`` (``2(x3),1``:
2 on each of the first three nodes, 1 on the last); without ``--ntasks`` only
``SLURM_JOB_CPUS_PER_NODE`` (same syntax) says how much each node has.  ``hvdlite run`` with no
``-H``/``--hostfile`` takes its hosts and ``-np``'s default from there; MPICH's and Intel MPI's
``mpiexec`` then start the ranks on the allocation's nodes through SLURM itself (no ssh).
Pure logic over a mapping, unit-tested.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

from .mpi_flavor import Host


class SlurmError(ValueError):
    """A SLURM variable that cannot be read (the message names it)."""


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for at, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as names, in order: ``node[01-03,07],gpu5`` ->
    ``node01 node02 node03 node07 gpu5`` (zero padding kept; several bracket groups in one
    name, ``rack[1-2]-n[1-2]``, multiply out as ``scontrol show hostnames`` does)."""
    names: list[str] = []
    for part in _split_top(text):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            if "[" in part or "]" in part:
                raise SlurmError(f"host list {text!r}: unbalanced brackets in {part!r}")
            names.append(part)
            continue
        head, tail = part[:match.start()], part[match.end():]
        for item in match.group(1).split(","):
            low, dash, high = item.strip().partition("-")
            if not low.isdigit() or (dash and not high.isdigit()):
                raise SlurmError(f"host list {text!r}: cannot read the range {item!r}")
            width = len(low)
            for number in range(int(low), int(high if dash else low) + 1):
                names.extend(expand_hostlist(f"{head}{number:0{width}d}{tail}"))
    return names


def expand_counts(text: str) -> list[int]:
    """SLURM's per-node counts: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in _split_top(text):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise SlurmError(f"per-node counts {text!r}: cannot read {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def allocation_hosts(environ: Mapping[str, str]) -> Optional[tuple[list[Host], str]]:
    """The allocation's nodes with their task counts (their CPUs when no task count was
    asked for) and where that was read, or None outside an allocation."""
    nodelist = environ.get("SLURM_JOB_NODELIST", "").strip() or \
        environ.get("SLURM_NODELIST", "").strip()
    if not nodelist:
        return None
    for variable in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"):
        counts_text = environ.get(variable, "").strip()
        if counts_text:
            break
    else:
        raise SlurmError("SLURM_JOB_NODELIST is set, but neither SLURM_TASKS_PER_NODE nor "
                         "SLURM_JOB_CPUS_PER_NODE says how many processes each node runs")
    names, counts = expand_hostlist(nodelist), expand_counts(counts_text)
    if len(names) != len(counts):
        raise SlurmError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(names)} nodes but "
                         f"{variable}={counts_text!r} gives {len(counts)} counts")
    where = f"the SLURM allocation (SLURM_JOB_NODELIST={nodelist}, {variable}={counts_text})"
    return [Host(name, count) for name, count in zip(names, counts)], where
