"""Pure logic of the Spark estimators' Horovod semantics (no Spark session, no ranks): labels
shaped like their outputs, one loss for every label, Horovod's default loss weights, metric
groups, the learning rate scaled by the number of ranks, and the parameters refused or renamed
in Horovod's accessors."""
from __future__ import annotations

import pytest

pytest.importorskip("pyspark", reason="pip install hvdlite[spark]")
torch = pytest.importorskip("torch")
from hvdlite.spark.torch import remote  # noqa: E402
from hvdlite.spark.torch import TorchEstimator, TorchModel  # noqa: E402


def test_a_label_takes_its_outputs_shape_when_they_hold_as_many_values():
    output = torch.arange(4.0).reshape(4, 1)          # a perfect regression prediction
    label = torch.arange(4.0)                          # a scalar label column: shape (4,)
    (matched,) = remote.match_labels([output], [label])
    assert matched.shape == (4, 1)
    assert float(torch.nn.MSELoss()(output, matched)) == 0.0
    # (unmatched, MSELoss would broadcast (4, 1) against (4,) to (4, 4): a loss of 2.5)
    logits, classes = torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
    assert remote.match_labels([logits], [classes])[0] is classes


def test_one_loss_serves_every_label_and_weights_default_to_one_over_n():
    mse = torch.nn.MSELoss()
    assert remote.per_label(mse, 3) == [mse, mse, mse]
    assert remote.per_label([mse, mse], 2) == [mse, mse]
    with pytest.raises(ValueError, match="3 losses for 2 label columns"):
        remote.per_label([mse] * 3, 2)
    assert remote.loss_weights_for(None, 2) == [0.5, 0.5]
    assert remote.loss_weights_for([1, 3], 2) == [1.0, 3.0]
    with pytest.raises(ValueError, match="1 loss_weights for 2 label"):
        remote.loss_weights_for([1.0], 2)


def test_metrics_are_plain_functions_or_horovods_groups():
    def acc(output, label):
        return 1.0

    def mae(output, label):
        return 2.0

    assert [(n, i) for n, _, i in remote.metric_table([acc], ["y"])] == [("acc", 0)]
    assert [(n, i) for n, _, i in remote.metric_table([acc], ["a", "b"])] == [
        ("acc_a", 0), ("acc_b", 1)]
    table = remote.metric_table([[acc], [acc, mae]], ["a", "b"])
    assert [(n, f, i) for n, f, i in table] == [
        ("group_0_a", acc, 0), ("group_0_b", acc, 1), ("group_1_a", acc, 0),
        ("group_1_b", mae, 1)]
    with pytest.raises(ValueError, match="metric group 0 has 3 functions for 2 label"):
        remote.metric_table([[acc, acc, acc]], ["a", "b"])
    with pytest.raises(ValueError, match="metrics\\[0\\]"):
        remote.metric_table(["accuracy"], ["a"])


def test_the_learning_rate_scales_per_parameter_group():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                                 {"params": [model.bias], "lr": 0.01}], lr=0.5)
    remote.scale_lr(optimizer, 4)
    assert [g["lr"] for g in optimizer.param_groups] == [0.4, 0.04]
    remote.scale_lr(optimizer, 1 / 4)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1, 0.01])


def test_keras_learning_rate_scales_and_a_schedule_is_refused():
    keras = pytest.importorskip("keras")
    from hvdlite.spark.keras.remote import scaled_optimizer_config
    config = keras.optimizers.serialize(keras.optimizers.SGD(0.1, momentum=0.9))
    scaled = keras.optimizers.deserialize(scaled_optimizer_config(config, 3))
    assert float(scaled.learning_rate) == pytest.approx(0.3)
    assert float(scaled.momentum) == pytest.approx(0.9)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    with pytest.raises(ValueError, match="cannot scale a schedule"):
        scaled_optimizer_config(keras.optimizers.serialize(keras.optimizers.SGD(schedule)), 2)


def test_horovods_parameters_are_accepted_or_refused_by_name():
    model = torch.nn.Linear(2, 1)
    estimator = TorchEstimator(model=model, val_batch_size=64, shuffle_buffer_size=0,
                               loss_weights=[1.0])
    assert estimator.getValBatchSize() == 64
    assert estimator.getShufflingBufferSize() == 0          # Horovod's accessor name
    assert estimator.getInMemoryCacheAll() is True           # Horovod's accessor name
    for name in ("sample_weight_col", "train_minibatch_fn", "label_shapes",
                 "compress_sparse_cols", "transformation_edit_fields"):
        with pytest.raises(ValueError, match=f"unsupported parameter.*{name}"):
            TorchEstimator(model=model, **{name: None})
    with pytest.raises(ValueError, match="loss or loss_constructors, not both"):
        TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                       loss=torch.nn.MSELoss(), loss_constructors=[torch.nn.MSELoss],
                       feature_cols=["f"], label_cols=["y"]).remote_trainer(None, "t", None)
    TorchEstimator(model=model, use_gpu=False)   # Horovod scripts' way of saying CPU
    with pytest.raises(ValueError, match="use_gpu=True: the estimators train on the CPU"):
        TorchEstimator(model=model, feature_cols=["f"], label_cols=["y"], use_gpu=True).check()
    with pytest.raises(ValueError, match="store is required"):
        TorchEstimator(model=model, feature_cols=["f"], label_cols=["y"]).check()
    fitted = TorchModel(b"", feature_cols=["f"], label_cols=["y"], history={}, run_id="r")
    assert fitted.getFeatureColumns() == ["f"] and fitted.getLabelColumns() == ["y"]
    assert fitted.getOutputCols() == ["y__output"]


def test_keras_refuses_checkpoint_callback_and_takes_backend_env():
    pytest.importorskip("keras")
    from hvdlite.spark.keras import KerasEstimator
    with pytest.raises(ValueError, match="unsupported parameter.*checkpoint_callback"):
        KerasEstimator(checkpoint_callback=object())
    assert KerasEstimator(backend_env={"A": "1"}).backend_env() == {"A": "1"}
    assert KerasEstimator(sample_weight_col="w").getSampleWeightCol() == "w"
