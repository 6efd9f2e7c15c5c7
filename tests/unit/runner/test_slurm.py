"""SLURM's host lists and per-node counts, as hvdlite run reads an allocation (issue 48)."""
import pytest

from hvdlite.runner.mpi_flavor import Host
from hvdlite.runner.slurm import SlurmError, allocation_hosts, expand_counts, expand_hostlist


@pytest.mark.parametrize("text, names", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("x[001-002],y,z[9]", ["x001", "x002", "y", "z9"]),
])
def test_expand_hostlist(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["node[1-", "node[a-b]", "node1]"])
def test_bad_hostlists_are_named(text):
    with pytest.raises(SlurmError, match="host list"):
        expand_hostlist(text)


def test_expand_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(SlurmError, match="cannot read"):
        expand_counts("2(x)")


def test_allocation_hosts():
    assert allocation_hosts({}) is None
    hosts, where = allocation_hosts({"SLURM_JOB_NODELIST": "n[1-2],m",
                                     "SLURM_TASKS_PER_NODE": "2(x2),1"})
    assert hosts == [Host("n1", 2), Host("n2", 2), Host("m", 1)] and "SLURM_TASKS_PER_NODE" in where
    hosts, where = allocation_hosts({"SLURM_JOB_NODELIST": "n1",
                                     "SLURM_JOB_CPUS_PER_NODE": "8"})
    assert hosts == [Host("n1", 8)] and "CPUS" in where
    with pytest.raises(SlurmError, match="names 2 nodes"):
        allocation_hosts({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1"})
    with pytest.raises(SlurmError, match="neither"):
        allocation_hosts({"SLURM_JOB_NODELIST": "n1"})
