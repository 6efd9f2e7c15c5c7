"""Elastic training's logic without an MPI job: ElasticSampler's arithmetic (Horovod's
definitions: horovod/torch/elastic/sampler.py), host discovery, blacklisting and placement
(horovod/runner/elastic/discovery.py, horovod/runner/common/util/hosts.py), the elastic flags,
how a commit is packed, the shield, how the driver judges a finished world, the Keras callbacks,
and the names each adapter offers (horovod/*/elastic.py)."""
from __future__ import annotations

import collections
import importlib
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from hvdlite.common.api.elastic_sampler import ElasticSamplerBase
from hvdlite.common.core import HostUpdateResult, elastic_wire
from hvdlite.runner import launch
from hvdlite.runner.elastic import hosts as hostmod
from hvdlite.runner.elastic import options, shield
from hvdlite.runner.elastic.driver import Discoverer, ElasticDriver, classify
from hvdlite.runner.elastic.provider import WorldRecord, ranks_on
from hvdlite.runner.elastic.server import CommitStore, Member
from hvdlite.runner.launch_errors import UsageError


# --- ElasticSampler ----------------------------------------------------------------------------
class Sampler(ElasticSamplerBase):
    """The sampler with the job's size and rank given here (no hvd.init)."""

    world = (1, 0)

    def _world(self):
        return self.world


def sampler(n: int, size: int, rank: int, seed: int = 0, shuffle: bool = True) -> Sampler:
    Sampler.world = (size, rank)
    return Sampler(list(range(n)), shuffle=shuffle, seed=seed)


def horovod_order(n: int, seed: int, epoch: int) -> list[int]:
    """Horovod's order of an epoch: range(n) shuffled by random.Random(seed + epoch)."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def test_sampler_shuffles_the_same_way_on_every_rank_and_differently_each_epoch():
    parts = [list(sampler(20, 4, r, seed=5)) for r in range(4)]
    order = horovod_order(20, 5, 0)
    assert parts == [order[r::4] for r in range(4)]
    s = sampler(20, 1, 0, seed=5)
    s.set_epoch(3)
    assert list(s) == horovod_order(20, 5, 3) != order
    assert list(sampler(6, 2, 1, shuffle=False)) == [1, 3, 5]


def test_sampler_pads_the_last_round_like_distributed_sampler():
    parts = [list(sampler(10, 4, r)) for r in range(4)]
    order = horovod_order(10, 0, 0)
    padded = order + order[:2]
    assert parts == [padded[r::4] for r in range(4)]
    assert all(len(p) == 3 for p in parts)
    few = [list(sampler(2, 5, r, shuffle=False)) for r in range(5)]
    assert few == [[0], [1], [0], [1], [0]]   # fewer samples than ranks: repeated as needed


@pytest.mark.parametrize("before, after, batches", [(4, 3, 2), (2, 4, 3), (3, 1, 1), (4, 4, 5)])
def test_sampler_deals_out_what_remains_after_a_reset(before, after, batches):
    n, batch = 50, 2
    ranks = [sampler(n, before, r, seed=9) for r in range(before)]
    done = []
    for r, s in enumerate(ranks):
        done += list(s)[:batches * batch]
    for s in ranks:
        for b in range(batches):
            s.record_batch(b, batch)
    committed = ranks[0].state_dict()
    assert committed == {"epoch": 0, "processed_num": batches * batch * before}
    assert sorted(done) == sorted(horovod_order(n, 9, 0)[:batches * batch * before])
    later = []
    for r in range(after):
        s = sampler(n, after, r, seed=9)
        s.load_state_dict(committed)
        later += list(s)
    counts = collections.Counter(done + later)
    assert set(counts) == set(range(n)), "a sample was skipped"
    assert sum(c - 1 for c in counts.values()) <= after - 1, "a sample was trained on twice"
    assert not set(done) & set(later[:len(later) - (after - 1)])


def test_sampler_epoch_end_clears_what_was_processed():
    s = sampler(10, 2, 0)
    s.record_batch(0, 2)
    assert s.processed_num == 4 and len(s) == 5   # the partition changes only at a reset
    s.load_state_dict(s.state_dict())
    assert len(s) == 3
    s.set_epoch(1)
    assert (s.epoch, s.processed_num, len(s)) == (1, 0, 5)


# --- hosts: discovery, blacklisting, placement ------------------------------------------------
def test_discovery_output_parsing():
    text = "h1:2\n\n  h2  \nh3:0\nh1:4\n"
    assert hostmod.parse_discovery_output(text, 3) == {"h1": 4, "h2": 3}
    with pytest.raises(hostmod.DiscoveryError, match=r"line 2 \('h2'\) gives no slots"):
        hostmod.parse_discovery_output("h1:1\nh2\n", None)
    with pytest.raises(hostmod.DiscoveryError, match="'x' is not a number of slots"):
        hostmod.parse_discovery_output("h1:x\n", None)
    with pytest.raises(hostmod.DiscoveryError, match="is not 'host' or 'host:slots'"):
        hostmod.parse_discovery_output("a b:1\n", None)


def test_discovery_script(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho node1:2\necho node2\n")
    script.chmod(0o755)
    assert hostmod.HostDiscoveryScript(str(script), 4).find_available_hosts_and_slots() == \
        {"node1": 2, "node2": 4}
    script.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    with pytest.raises(hostmod.DiscoveryError, match=r"exited with status 3 \(oops\)"):
        hostmod.HostDiscoveryScript(str(script), 1).find_available_hosts_and_slots()


def test_host_updates_and_order():
    manager = hostmod.HostManager()
    added, removed = HostUpdateResult.added, HostUpdateResult.removed
    assert manager.update({"a": 2, "b": 2}, now=0) == added
    assert manager.update({"a": 2, "b": 2}, now=1) == HostUpdateResult.no_update
    assert manager.update({"c": 1, "b": 2, "a": 2}, now=2) == added
    assert manager.order == ["a", "b", "c"]   # the oldest keep the lowest ranks
    assert manager.update({"a": 1, "c": 1}, now=3) == removed   # b gone, a lost a slot
    assert manager.update({"a": 3, "c": 1, "d": 1}, now=4) == added
    assert manager.update({"a": 2, "e": 1}, now=5) == HostUpdateResult.mixed
    assert manager.available() == [("a", 2), ("e", 1)]


def test_blacklisting_without_a_cooldown_lasts():
    manager = hostmod.HostManager()
    manager.update({"a": 2, "b": 2}, now=0)
    manager.blacklist("b", now=0)
    assert manager.available() == [("a", 2)]
    assert manager.update({"a": 2, "b": 2}, now=10 ** 6) == HostUpdateResult.no_update
    assert manager.is_blacklisted("b")
    assert "b (for the rest of the job)" in manager.describe(now=5)


def test_blacklisting_with_a_cooldown_backs_off_exponentially():
    # Horovod: the n-th blacklisting lasts low * 2**n + uniform(0, 1) * low, clamped to
    # [low, high]; after it the host counts as added again.
    manager = hostmod.HostManager(cooldown_range=(10, 100), rng=random.Random(0))
    draws = random.Random(0)
    manager.update({"a": 1, "b": 1}, now=0)
    manager.blacklist("b", now=0)
    first = min(100, 10 * 2 + draws.uniform(0, 1) * 10)
    assert manager.update({"a": 1, "b": 1}, now=first - 0.01) == HostUpdateResult.no_update
    assert manager.is_blacklisted("b")
    assert manager.update({"a": 1, "b": 1}, now=first) == HostUpdateResult.added
    assert not manager.is_blacklisted("b")
    manager.blacklist("b", now=first)
    manager.blacklist("b", now=first + 1)   # within its cooldown: no longer
    second = min(100, 10 * 4 + draws.uniform(0, 1) * 10)
    assert manager.states["b"].cooldown_end == pytest.approx(first + second)
    for _ in range(5):
        manager.states["b"].whitelist()
        manager.blacklist("b", now=0)
    assert manager.states["b"].cooldown_end == 100   # capped at high


def test_cooldown_range_bounds():
    hostmod.check_cooldown_range(1, 3600)
    for low, high, fragment in [(0, 5, "below 1 s"), (5, 3601, "above 3600 s"),
                                (9, 8, "lower limit is above the upper one")]:
        with pytest.raises(ValueError, match=fragment):
            hostmod.check_cooldown_range(low, high)


def test_placement_fills_hosts_in_order_up_to_max_np():
    hosts = [("a", 2), ("b", 2), ("c", 4)]
    assert hostmod.assign(hosts, None) == hosts
    assert hostmod.assign(hosts, 5) == [("a", 2), ("b", 2), ("c", 1)]
    assert hostmod.assign(hosts, 2) == [("a", 2)]


# --- the elastic flags -------------------------------------------------------------------------
def settings(*flags: str, environ=None):
    args = launch.parse_args([*flags, "python", "train.py"])
    return options.settings_from_args(args, environ or {})


def test_elastic_flags_make_settings(tmp_path):
    got = settings("-np", "4", "--min-np", "2", "--max-np", "8", "-H", "a:2,b:2",
                   "--reset-limit", "3", "--blacklist-cooldown-range", "5", "50",
                   "--elastic-timeout", "30")
    assert (got.start_np, got.min_np, got.max_np, got.reset_limit, got.cooldown_range,
            got.elastic_timeout) == (4, 2, 8, 3, (5, 50), 30.0)
    assert got.discovery.find_available_hosts_and_slots() == {"a": 2, "b": 2}
    only_hosts = settings("--max-np", "8", "-H", "a:2,b:3")
    assert (only_hosts.start_np, only_hosts.min_np) == (5, 5)
    script = settings("--min-np", "2", "--host-discovery-script", "d.sh", "--slots", "4",
                      environ={"HOROVOD_ELASTIC_TIMEOUT": "42"})
    assert (script.start_np, script.elastic_timeout) == (2, 42.0)
    assert (script.discovery.script, script.discovery.default_slots) == ("d.sh", 4)
    assert settings("--min-np", "1", "-H", "a:1").elastic_timeout == 600
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb:1\n")
    assert settings("--min-np", "1", "--hostfile", str(hostfile)).discovery.host_slots == \
        {"a": 2, "b": 1}


@pytest.mark.parametrize("flags, fragment", [
    (["--min-np", "2", "--host-discovery-script", "d.sh", "-H", "a:2"], "one way"),
    (["--min-np", "2"], "needs its hosts"),
    (["--host-discovery-script", "d.sh"], "needs -np N or --min-np N"),
    (["-np", "1", "--min-np", "2", "-H", "a:4"], "-np 1 is below --min-np 2"),
    (["--min-np", "4", "--max-np", "2", "-H", "a:4"], "--max-np 2 is below"),
    (["--min-np", "2", "--slots-per-host", "2", "-H", "a:4"], "--slots-per-host is for"),
    (["--min-np", "2", "-H", "a:4", "--blacklist-cooldown-range", "9", "3"], "above the upper"),
])
def test_inconsistent_elastic_flags_are_refused(flags, fragment):
    with pytest.raises(UsageError, match=fragment):
        settings(*flags)


def test_elastic_is_what_the_flags_ask_for():
    assert not options.requested(launch.parse_args(["-np", "2", "python", "t.py"]))
    for flags in (["--min-np", "1"], ["--max-np", "3"], ["--host-discovery-script", "s"]):
        assert options.requested(launch.parse_args(flags + ["python", "t.py"]))
    with pytest.raises(SystemExit):
        launch.parse_args(["--reset-limit", "-1", "python", "t.py"])


def test_elastic_timeout_from_the_environment_is_checked():
    with pytest.raises(UsageError, match="HOROVOD_ELASTIC_TIMEOUT='soon'"):
        settings("--min-np", "1", "-H", "a:1", environ={"HOROVOD_ELASTIC_TIMEOUT": "soon"})


# --- packing a commit --------------------------------------------------------------------------
def roundtrip(tree):
    packed = elastic_wire.pack(tree)
    frames = [bytearray(frame) for frame in packed.frames()]
    return packed, elastic_wire.unpack(frames)


def test_pack_sends_arrays_out_of_band_and_objects_inline():
    big = np.arange(12, dtype=np.float64).reshape(3, 4)
    ragged = np.array([[1], [2, 3]], dtype=object)   # objects: pickled in band
    packed, back = roundtrip({"weights": big, "epoch": 4, "ragged": ragged, "xs": [1, 2]})
    assert [codec.kind for codec, _ in packed.leaves] == ["numpy"]
    assert len(packed.header) < 400
    np.testing.assert_array_equal(back["weights"], big)
    assert back["weights"].dtype == np.float64 and back["epoch"] == 4 and back["xs"] == [1, 2]
    assert back["ragged"][1] == [2, 3]


def test_object_state_keeps_its_values_as_they_were_at_the_commit():
    from hvdlite.common.api import elastic as core
    state = core.ObjectState(lambda obj: obj, lambda: 0, history=[1, 2])
    committed = state.committed_state()
    state.history.append(3)   # changed in place after the commit (save() keeps references)
    _, back = roundtrip(committed)
    again = core.ObjectState(lambda obj: obj, lambda: 0, history=[])
    again.load_committed_state(back)
    assert again.history == [1, 2]


def test_torch_tensors_travel_as_raw_bytes():
    torch = pytest.importorskip("torch")
    importlib.import_module("hvdlite.torch.elastic")   # registers the torch codec
    tensors = {"f": torch.randn(3, 5), "bf": torch.randn(4).to(torch.bfloat16),
               "b": torch.tensor([True, False]), "scalar": torch.tensor(7, dtype=torch.int64),
               "empty": torch.zeros(0, 3), "strided": torch.randn(4, 6)[:, ::2],
               "grad": torch.randn(2, requires_grad=True)}
    sparse = torch.eye(3).to_sparse()   # torch pickles it as its (dense) parts
    packed, back = roundtrip({**tensors, "sparse": sparse})
    assert {codec.kind for codec, _ in packed.leaves} == {"torch"}
    assert len(packed.leaves) >= len(tensors) and len(packed.header) < 2000
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor.detach()), name
    assert torch.equal(back["sparse"].to_dense(), torch.eye(3))


# --- the shield ----------------------------------------------------------------------------------
def run_shield(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvdlite.runner.elastic.shield", "--",
                           *command], capture_output=True, text=True, timeout=60)


def test_shield_runs_the_worker_in_its_own_session_and_passes_its_status_on():
    assert shield.SHIELD_VARIABLE == elastic_wire.SHIELD_VARIABLE
    probe = ("import os; print(os.environ['HVDLITE_ELASTIC_SHIELD'] == str(os.getppid()), "
             "os.getsid(0) == os.getpid()); raise SystemExit(7)")
    done = run_shield(sys.executable, "-c", probe)
    assert (done.returncode, done.stdout.split()) == (7, ["True", "True"]), done.stderr
    assert run_shield("sh", "-c", "kill -TERM $$").returncode == -15
    missing = run_shield("/nonexistent/program")
    assert missing.returncode == 127 and "cannot run /nonexistent/program" in missing.stderr


# --- how the driver judges a world that ended ---------------------------------------------------
def world_of(placement, returncode, members, lost=()):
    world = WorldRecord(0, placement, ranks_on(placement), 0.0, status=returncode)
    if returncode == 0:   # as the launcher's provider records a launcher that exited cleanly
        world.results = dict.fromkeys(range(world.size))
    for rank, outcome in members.items():
        world.members[rank] = Member(0, rank, world.size, world.host_of[rank], 1,
                                     outcome=outcome, ended_at=1.0)
        if outcome and outcome[0] == "error":   # as the driver records the report
            world.raised[rank] = outcome[1]
    world.lost = list(lost)
    world.failed_at = 1.0 if lost or any(o and o[0] in ("reset", "error")
                                         for o in members.values()) else None
    return world


def test_a_world_that_finished_training_ends_the_job():
    end = classify(world_of([("a", 2)], 0, {0: ("done", "", []), 1: ("done", "", [])}))
    assert (end.kind, end.status) == ("done", 0)
    end = classify(world_of([("a", 2)], 0, {0: None, 1: None}))   # no elastic.run at all
    assert end.kind == "done"


def test_the_first_worker_lost_is_blamed_not_those_that_went_down_with_it():
    reset = ("reset", "RankExitedError: rank 3 on b exited", [3])
    end = classify(world_of([("a", 2), ("b", 2)], 75,
                            {0: reset, 1: reset, 2: None, 3: None}, lost=[3, 2]))
    assert (end.kind, end.culprits) == ("reset", [3])
    assert "rank 3 on b exited without a word" in end.reason


def test_a_worker_that_raised_is_blamed():
    reset = ("reset", "RankExitedError", [1])
    end = classify(world_of([("a", 1), ("b", 1), ("c", 1)], 1,
                            {0: reset, 1: ("error", "ValueError: bad shard", []), 2: reset}))
    assert (end.kind, end.culprits) == ("reset", [1])
    assert "rank 1 raised ValueError: bad shard" in end.reason


def test_a_world_where_every_rank_failed_on_its_own_stops_the_job():
    error = ("error", "KeyError: 'x'", [])
    end = classify(world_of([("a", 2)], 1, {0: error, 1: error}))
    assert end.kind == "failed" and "every rank of world 0 failed" in end.reason
    end = classify(world_of([("a", 1)], 255, {0: None}, lost=[0]))
    assert end.kind == "failed"
    end = classify(world_of([("a", 2)], 1, {}))
    assert end.kind == "failed" and "no worker of world 0" in end.reason


def test_workers_that_never_reported_in_are_blamed_for_a_failed_start():
    end = classify(world_of([("a", 1), ("b", 1)], 1, {0: ("reset", "RankExitedError", [])}))
    assert (end.kind, end.culprits) == ("reset", [1])


def test_a_host_update_blames_nobody():
    stop = ("interrupt", "hosts changed", [])
    end = classify(world_of([("a", 2)], 75, {0: stop, 1: stop}))
    assert (end.kind, end.culprits, end.reason) == ("reset", [], "the hosts changed")


# --- the driver's store of commits ---------------------------------------------------------------
def test_commit_store_keeps_the_newest_and_asks_one_rank_to_upload():
    store = CommitStore()
    assert store.have(0, (0, 3), owner="rank1") == "send"
    store.begin_upload(0, (0, 3), "rank1")
    assert store.finish_upload(0, (0, 3), [bytearray(b"new")], "rank1") == (0, 3)
    assert store.have(0, (0, 3), owner="rank2") == "ok"
    assert store.finish_upload(0, (0, 2), [bytearray(b"old")], "rank0") == (0, 3)
    assert store.get(0) == ((0, 3), [bytearray(b"new")])
    assert store.have(0, (1, 1), owner="rank1") == "send"
    store.abandon("rank1")   # its connection ended mid-upload: another rank is asked
    assert store.have(0, (1, 1), owner="rank2") == "send"


# --- the Keras callbacks -------------------------------------------------------------------------
class FakeState:
    def __init__(self) -> None:
        self.epoch, self.batch, self.commits = 2, 0, []

    def commit(self) -> None:
        self.commits.append((self.epoch, self.batch))


def test_keras_callbacks_commit_and_count_as_horovod_s():
    pytest.importorskip("tensorflow")
    from hvdlite.tensorflow.keras import elastic
    state = FakeState()
    epoch_cb = elastic.UpdateEpochStateCallback(state)
    batch_cb = elastic.UpdateBatchStateCallback(state)
    commit_cb = elastic.CommitStateCallback(state, batches_per_commit=2)
    callbacks = [epoch_cb, batch_cb, commit_cb]
    for cb in callbacks:
        cb.set_params({"steps": 5})
        cb.on_train_begin()
    for epoch in range(2):
        for cb in callbacks:
            cb.on_epoch_begin(epoch)
        for batch in range(5):
            for cb in callbacks:
                cb.on_train_batch_end(batch)
        for cb in callbacks:
            cb.on_epoch_end(epoch)
    # every second batch, counted across epochs, and at each epoch end (after the epoch was
    # counted and the batch reset: the callbacks run in the order given, as in Horovod's
    # examples)
    assert state.commits == [(2, 1), (2, 3), (3, 0), (3, 0), (3, 2), (3, 4), (4, 0)]
    assert (state.epoch, state.batch) == (4, 0)
    state.batch = 3   # a reset in the middle of an epoch: Horovod asks for a shorter epoch
    batch_cb.on_train_begin()
    batch_cb.on_epoch_begin(0)
    assert batch_cb.params["steps"] == 2


# --- the names ---------------------------------------------------------------------------------
HOROVOD_NAMES = {
    "hvdlite.torch": ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
                      "get_handler_registry", "set_handler_registry"],
    "hvdlite.tensorflow": ["run", "State", "ObjectState", "TensorFlowKerasState",
                           "TensorFlowState"],
    "hvdlite.tensorflow.keras": ["run", "KerasState", "CommitStateCallback",
                                 "UpdateBatchStateCallback", "UpdateEpochStateCallback",
                                 "TensorFlowKerasState"],
    "hvdlite.keras": ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
                      "UpdateEpochStateCallback"],
}


@pytest.mark.parametrize("adapter", sorted(HOROVOD_NAMES))
def test_each_adapter_offers_horovods_elastic_names(adapter):
    pytest.importorskip("torch" if adapter == "hvdlite.torch" else "tensorflow")
    hvd = importlib.import_module(adapter)
    missing = [name for name in HOROVOD_NAMES[adapter] if not hasattr(hvd.elastic, name)]
    assert not missing, missing
    assert hvd.HorovodInternalError is hvd.elastic.HorovodInternalError
    assert hvd.HostsUpdatedInterrupt is hvd.elastic.HostsUpdatedInterrupt
    assert not issubclass(hvd.HostsUpdatedInterrupt, hvd.HorovodInternalError)
    assert hvd.HostsUpdatedInterrupt(True).skip_sync is True


def test_keras_names_are_the_tensorflow_keras_objects():
    pytest.importorskip("tensorflow")
    import hvdlite.keras.elastic as k
    import hvdlite.tensorflow.keras.elastic as tk
    assert k.KerasState is tk.KerasState and k.run is tk.run


def test_elastic_states_need_to_say_what_outlives_the_processes():
    from hvdlite.common.api import elastic as core

    class Custom(core.State):
        def save(self):
            pass

    with pytest.raises(TypeError, match="Custom does not implement committed_state"):
        core._require_committable(Custom(lambda x: x, lambda: 0))
    core._require_committable(core.ObjectState(lambda x: x, lambda: 0, epoch=1))


def test_object_state_keeps_horovods_semantics_in_process():
    from hvdlite.common.api import elastic as core
    broadcasts = []
    state = core.ObjectState(lambda obj: broadcasts.append(obj) or obj, lambda: 0,
                             epoch=0, batch=5)
    state.epoch, state.batch = 3, 9
    state.restore()
    assert (state.epoch, state.batch) == (0, 5)
    state.epoch = 4
    state.save()
    state.epoch = 7
    state.sync()   # broadcasts the saved values, not the live ones (Horovod)
    assert broadcasts == [{"epoch": 4, "batch": 5}] and state.epoch == 4
    again = core.ObjectState(lambda obj: obj, lambda: 0, epoch=0, batch=0)
    again.load_committed_state(state.committed_state())
    assert (again.epoch, again.batch) == (4, 5)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])
    state.on_hosts_updated(1, HostUpdateResult.added)
    state.on_reset()
    assert calls == ["reset"] and state._host_messages.empty()


def test_host_checks_cost_nothing_without_the_driver():
    from hvdlite.common.api import elastic as core
    state = core.ObjectState(lambda obj: obj, lambda: 0, epoch=0)
    state.on_hosts_updated(5, HostUpdateResult.added)
    state.check_host_updates()   # no driver, no collective: nothing raised
    assert state._hvd_agreement is None


def test_too_few_slots_wait_for_the_elastic_timeout_then_say_what_is_missing():
    from hvdlite.runner.elastic.launcher import (ElasticError, LauncherProvider, say,
                                                 timeout_error)
    from hvdlite.runner.elastic.options import ElasticSettings
    discovery = hostmod.FixedHosts({"a": 1, "b": 2})
    settings = ElasticSettings(start_np=2, min_np=2, max_np=None, discovery=discovery,
                               reset_limit=None, cooldown_range=None, elastic_timeout=0.3)
    provider = LauncherProvider.__new__(LauncherProvider)
    driver = ElasticDriver(provider, settings, say, ElasticError, timeout_error(settings))
    discoverer = Discoverer(discovery, say)   # not started: its first answer stays
    assert driver.wait_for_slots(discoverer, 2) == [("a", 1), ("b", 2)]
    driver.manager.blacklist("b")
    with pytest.raises(ElasticError) as info:
        driver.wait_for_slots(discoverer, 2)
    message = str(info.value)
    assert "waited 0.3 s (--elastic-timeout) for 2 slots" in message, message
    assert "only 1 are available from the hosts of -H/--hostfile" in message, message
    assert "available: a:1" in message and "b (for the rest of the job)" in message, message


def test_the_server_waits_only_for_the_reports_of_workers_in_an_elastic_session():
    from hvdlite.common.runtime.elastic_channel import Channel
    from hvdlite.runner.elastic.server import Server
    server = Server("127.0.0.1", report_events=False)
    try:
        plain, elastic = (Channel(("127.0.0.1", server.port), server.key, 0) for _ in range(2))
        plain.connect(0, 2, "a")
        elastic.connect(1, 2, "a")
        elastic.tell(("session",))
        deadline = time.monotonic() + 10
        while not server.world_members(0).get(1, Member(0, 1, 2, "a", 0)).in_session:
            assert time.monotonic() < deadline
        assert server.events.empty()                        # report_events=False keeps none
        assert server.wait_for_reports(0, 0.2) is False     # rank 1 has not reported
        assert elastic.request(("outcome", "reset", "lost rank 0", [0]))[0] == "bye"
        assert server.wait_for_reports(0, 5) is True        # rank 0 (no session) not awaited
    finally:
        server.close()


def test_desired_placement_is_empty_below_min_np_and_fills_up_to_max_np():
    available = [("a", 2), ("b", 2)]
    assert hostmod.desired_placement(available, 5, None) == []
    assert hostmod.desired_placement(available, 4, None) == [("a", 2), ("b", 2)]
    assert hostmod.desired_placement(available, 1, 3) == [("a", 2), ("b", 1)]
