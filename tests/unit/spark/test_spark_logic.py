"""Pure logic of hvdlite.spark (no Spark session, no ranks): timeouts, world sizes, the
start-timeout and failure messages, output tags, the data shards, the store and the
estimators' parameters."""
from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="pip install hvdlite[spark]")
from hvdlite.spark import runner  # noqa: E402
from hvdlite.spark.common import data  # noqa: E402
from hvdlite.spark.common.store import LocalStore, Store  # noqa: E402
from hvdlite.runner.elastic.hosts import desired_placement  # noqa: E402
from hvdlite.spark.elastic import SparkSlots  # noqa: E402
from hvdlite.spark.torch.remote import shaped  # noqa: E402


def test_start_timeout_comes_from_the_argument_then_hvdlite_then_horovod_then_600():
    assert runner.start_timeout_s(5, {}) == 5.0
    assert runner.start_timeout_s(None, {"HOROVOD_SPARK_START_TIMEOUT": "30"}) == 30.0
    assert runner.start_timeout_s(None, {"HOROVOD_SPARK_START_TIMEOUT": "30",
                                         "HVDLITE_SPARK_START_TIMEOUT": "20"}) == 20.0
    assert runner.start_timeout_s(None, {}) == 600.0
    with pytest.raises(ValueError, match="HOROVOD_SPARK_START_TIMEOUT must be a number"):
        runner.start_timeout_s(None, {"HOROVOD_SPARK_START_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="start_timeout must be positive"):
        runner.start_timeout_s(-1, {})


def test_world_sizes_follow_the_slots_within_the_bounds(monkeypatch):
    # run_elastic's worlds: the cluster's task slots as one host, placed by the elastic driver
    def size(slots: int):
        monkeypatch.setattr("hvdlite.spark.elastic.task_slots", lambda context: slots)
        placement = desired_placement(list(SparkSlots(None).find_available_hosts_and_slots()
                                           .items()), min_np=2, max_np=4)
        return sum(n for _, n in placement) or None
    assert size(5) == 4
    assert size(3) == 3
    assert size(1) is None
    assert size(0) is None


def test_the_driver_listens_where_spark_reaches_it():
    assert runner.driver_addresses({"spark.driver.host": "10.0.0.5"}) == ("10.0.0.5",
                                                                          "10.0.0.5")
    assert runner.driver_addresses({"spark.driver.host": "node-1",
                                    "spark.driver.bindAddress": "0.0.0.0"}) == ("0.0.0.0",
                                                                                "node-1")
    assert runner.driver_addresses({}) == ("127.0.0.1", "127.0.0.1")


def test_the_start_timeout_message_names_the_tasks_and_the_slots():
    progress = runner.Progress(4, io.StringIO(), io.StringIO(), False)
    message = progress.describe_start(10, slots=2)
    assert "Tasks (partitions) [0, 1, 2, 3] never started (0 of 4 did)" in message
    assert "needs 4 free task slots; the cluster offers 2" in message
    for p in range(4):
        progress.on_started(p, f"10.0.0.{p}:7077", 100 + p)
    progress.on_formed(0, 0, "a")
    progress.on_failed(3, "FormationError: mpiexec exited")
    message = progress.describe_start(10, slots=4)
    assert "never started" not in message
    assert "Tasks [1, 2, 3] started but never joined" in message and "10.0.0.1:7077" in message
    assert "partition 3: FormationError: mpiexec exited" in message


def test_output_is_tagged_per_rank_and_stream_like_horovodrun():
    out, err = io.StringIO(), io.StringIO()
    progress = runner.Progress(2, out, err, timestamps=False)
    progress.on_output(1, 1, b"hello\n")
    progress.on_output(0, 2, b"no newline at the end")
    assert out.getvalue() == "[1]<stdout>:hello\n"
    assert err.getvalue() == "[0]<stderr>:no newline at the end\n"
    stamped = io.StringIO()
    runner.Progress(1, stamped, err, timestamps=True).on_output(0, 1, b"x\n")
    assert stamped.getvalue().split(":[0]<stdout>:")[1] == "x\n"


def test_a_failed_jobs_summary_prefers_the_tasks_own_words():
    jvm = ("An error occurred while calling o1.collect.\n"
           "org.apache.spark.SparkException: Job aborted\n"
           "hvdlite.spark.task.RankFailed: rank 1 (Spark partition 0, host h) was killed by "
           "signal 9 (SIGKILL)\n\tat org.apache.spark.Foo(Foo.scala:1)\n"
           "hvdlite.spark.task.RankFailed: rank 1 (Spark partition 0, host h) was killed by "
           "signal 9 (SIGKILL)\n")
    assert runner.spark_error_summary(RuntimeError(jvm)) == (
        "hvdlite.spark.task.RankFailed: rank 1 (Spark partition 0, host h) was killed by "
        "signal 9 (SIGKILL)")
    plain = runner.spark_error_summary(RuntimeError("Job aborted\n\tat a.b(c)\nreason"))
    assert plain == "Job aborted\nreason"


@pytest.mark.parametrize("pieces, size", [(10, 3), (3, 3), (7, 2)])
def test_row_groups_are_dealt_disjoint_and_covering(pieces, size):
    plans = [data.shard_plan(pieces, rank, size) for rank in range(size)]
    dealt = sorted(i for plan in plans for i in plan)
    assert dealt == list(range(pieces))
    assert max(map(len, plans)) - min(map(len, plans)) <= 1


def test_fewer_row_groups_than_ranks_share_rows_instead(tmp_path):
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    assert data.shard_plan(2, 0, 3) is None
    (tmp_path / "d").mkdir()
    table = pa.table({"x": [[float(i), float(-i)] for i in range(10)], "y": list(range(10))})
    pq.write_table(table, str(tmp_path / "d" / "part-0.parquet"))
    fs = pyarrow.fs.LocalFileSystem()
    shards = [data.read_shard(fs, str(tmp_path / "d"), rank, 3) for rank in range(3)]
    assert sorted(v for s in shards for v in s["y"].tolist()) == list(range(10))
    assert shards[1]["y"].tolist() == [1, 4, 7]
    assert shards[1]["x"].tolist() == [[1.0, -1.0], [4.0, -4.0], [7.0, -7.0]]
    assert data.stack(shards[1], ["x", "y"]).tolist() == [[1, -1, 1], [4, -4, 4], [7, -7, 7]]


def test_row_groups_of_several_files_go_round_robin(tmp_path):
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    for f in range(2):
        pq.write_table(pa.table({"y": list(range(f * 100, f * 100 + 30))}),
                       str(tmp_path / f"part-{f}.parquet"), row_group_size=10)
    fs = pyarrow.fs.LocalFileSystem()
    shards = [data.read_shard(fs, str(tmp_path), rank, 2)["y"].tolist() for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(30)) + list(range(100, 130))
    assert len(shards[0]) == len(shards[1]) == 30


def test_the_store_lays_out_a_run_and_keeps_bytes(tmp_path):
    store = Store.create(f"file://{tmp_path}")
    assert isinstance(store, LocalStore) and store.prefix_path == str(tmp_path)
    path = store.get_checkpoint_path("run1")
    assert path.startswith(store.get_run_path("run1"))
    assert not store.exists(path)
    store.write(path, b"model")
    assert store.read(path) == b"model"
    store.remove(store.get_run_path("run1"))
    assert not store.exists(path)
    assert store.get_train_data_path("r").endswith("intermediate_train_data.r")
    with pytest.raises(ValueError, match="subclass"):
        Store.create("s3://bucket/path")


def test_input_shapes_reshape_the_stacked_features_per_sample():
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    assert shaped(x, [[-1, 1, 8, 8]]).shape == (2, 1, 8, 8)
    assert shaped(x, [[1, 8, 8]]).shape == (2, 1, 8, 8)
    assert shaped(x, None) is x


def test_estimator_parameters_have_horovods_accessors_and_refusals():
    from hvdlite.spark.torch import TorchEstimator
    estimator = TorchEstimator(model=object(), feature_cols=["f"], label_cols=["l"],
                               epochs=3)
    assert estimator.getEpochs() == 3 and estimator.getFeatureCols() == ["f"]
    assert estimator.setLabelCols(["m"]) is estimator and estimator.getLabelCols() == ["m"]
    assert estimator.getInmemoryCacheAll() is True
    with pytest.raises(AttributeError):
        estimator.getNoSuchThing()
    with pytest.raises(ValueError, match="gradient_compression"):
        TorchEstimator(gradient_compression="fp16")
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        TorchEstimator(model=object(), feature_cols=["f"], label_cols=["l"], epochs=0).check()
    with pytest.raises(ValueError, match="inmemory_cache_all=False"):
        TorchEstimator(model=object(), feature_cols=["f"], label_cols=["l"],
                       inmemory_cache_all=False).check()
