"""The MPI world's launcher side without Ray: mpiexec -launcher manual, its proxy commands, the
placeholders' PMI environments, and the teardown (no process left)."""
from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")

from hvdlite.common.runtime.hydra_world import (PMI_VARIABLES, MpiWorld, WorldError, host_segments,
                               parse_pmi_line)
from tests.ray.procs import children, wait_gone


def test_host_segments_group_consecutive_ranks():
    assert host_segments(["a", "a", "b"]) == [("a", 2), ("b", 1)]
    assert host_segments(["a"]) == [("a", 1)]


def test_host_segments_refuse_a_node_split_in_two():
    with pytest.raises(WorldError, match="node a do not have consecutive world ranks"):
        host_segments(["a", "b", "a"])


def test_parse_pmi_line():
    line = "HVDLITE_PMI " + " ".join(f"{v}=1" for v in PMI_VARIABLES)
    assert parse_pmi_line(line) == {v: "1" for v in PMI_VARIABLES}
    assert parse_pmi_line("something else") is None
    with pytest.raises(WorldError, match="unexpected placeholder line"):
        parse_pmi_line("HVDLITE_PMI PMI_ID=x")


def _start_world(nodes):
    """A world on ``nodes`` whose proxies this test runs (as the Ray workers would)."""
    world = MpiWorld(nodes, "127.0.0.1", timeout_s=20)
    commands = world.start()
    assert len(commands) == len(set(nodes)) and all("hydra_pmi_proxy" in c[0] for c in commands)
    proxies = [subprocess.Popen(c, stdout=subprocess.DEVNULL, start_new_session=True)
               for c in commands]
    return world, proxies


@pytest.mark.timeout(60)
def test_world_hands_out_each_rank_its_environment_and_ends_cleanly_when_released():
    world, proxies = _start_world(["127.0.0.1"] * 2 + ["127.0.0.2"])
    launcher = world._proc
    try:
        envs = world.environments()
        assert [int(e["PMI_ID"]) for e in envs] == [0, 1, 2]
        assert [(e["MPI_LOCALRANKID"], e["MPI_LOCALNRANKS"]) for e in envs] == [
            ("0", "2"), ("1", "2"), ("0", "1")]
        placeholders = [c for p in proxies for c in children(p.pid)]
        assert len(placeholders) == 3
        open(world.release_path, "w").close()   # what member.stop_proxy does on each host
        # every rank exits 0, so the proxies and mpiexec end by themselves, successfully
        assert [p.wait(10) for p in proxies] == [0, 0]
        assert launcher.wait(10) == 0
    finally:
        world.close()
        os.unlink(world.release_path)
    assert wait_gone([launcher.pid] + placeholders) == []


@pytest.mark.timeout(60)
def test_closing_an_unreleased_world_ends_everything():
    world, proxies = _start_world(["127.0.0.1"] * 2)
    try:
        world.environments()
        placeholders = [c for p in proxies for c in children(p.pid)]
        pids = [world.pid] + [p.pid for p in proxies] + placeholders
    finally:
        world.close()   # a run that failed: mpiexec is killed, its proxies and placeholders go
    for proc in proxies:
        proc.wait(10)
    assert not world.running
    assert wait_gone(pids) == []


@pytest.mark.timeout(60)
def test_world_times_out_clearly_when_no_proxy_runs():
    world = MpiWorld(["127.0.0.1"], "127.0.0.1", timeout_s=2)
    try:
        world.start()
        with pytest.raises(WorldError, match=r"did not start every rank's placeholder .*within "
                                             r"2 s \(ranks ready: \[\] of 1\)"):
            world.environments()
    finally:
        world.close()
    assert not world.running
