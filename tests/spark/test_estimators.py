"""The Spark ML estimators, used as Horovod's own Spark examples use them
(examples/spark/pytorch/pytorch_spark_mnist.py and examples/spark/keras/keras_spark_mnist.py:
``Store.create``, ``SparkBackend``, a conv net on a vector of pixels reshaped by
``input_shapes`` or the Keras input shape, one-hot labels from ``OneHotEncoder``,
``setOutputCols``, an argmax UDF and ``MulticlassClassificationEvaluator``), on sklearn's digits
(8x8 images) with two ranks on local-cluster[2,1,1024]."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tests.spark.conftest import bounded, require_spark

require_spark()   # (at collection: skips or fails the module)
from hvdlite.spark.common.backend import SparkBackend  # noqa: E402
from hvdlite.spark.common.store import LocalStore, Store  # noqa: E402


def digits_frames(spark):
    """(train, test) DataFrames: "features" (a 64-pixel vector in [0, 1]), "label" (a double),
    "label_vec" (one-hot, from Spark's OneHotEncoder), "is_val" (a fifth of the rows)."""
    from pyspark.ml.feature import OneHotEncoder
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25,
                                                        random_state=0)

    def frame(xs, ys):
        return spark.createDataFrame([(Vectors.dense(f), float(label), i % 5 == 0)
                                      for i, (f, label) in enumerate(zip(xs, ys))],
                                     ["features", "label", "is_val"])
    train, test = frame(x_train, y_train), frame(x_test, y_test)
    encoder = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"],
                            dropLast=False).fit(train)
    return encoder.transform(train).repartition(4), encoder.transform(test)


def test_accuracy(pred_df) -> float:
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import types as T
    from pyspark.sql.functions import udf
    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    return MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                             metricName="accuracy").evaluate(pred_df)


test_accuracy.__test__ = False   # a helper, not a test


def conv_net():
    """Horovod's example network, sized for 8x8 digits (torch imported only where it runs)."""
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 16, kernel_size=3)
            self.conv2 = torch.nn.Conv2d(16, 32, kernel_size=2)
            self.fc1 = torch.nn.Linear(128, 64)
            self.fc2 = torch.nn.Linear(64, 10)

        def forward(self, features):
            x = features.float()
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(self.conv2(x))
            x = x.view(-1, 128)
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    torch.manual_seed(0)
    return Net()


def accuracy(output, label) -> float:
    return float((output.argmax(dim=1) == label.long()).float().mean())


def test_torch_estimator_as_horovods_example_uses_it(spark_cluster, tmp_path):
    import torch
    import hvdlite.spark.torch as hvd
    train_df, test_df = digits_frames(spark_cluster)
    store = Store.create(str(tmp_path))
    assert isinstance(store, LocalStore)
    model = conv_net()
    # (scaled by the 2 ranks for training, as Horovod does)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9)
    loss = torch.nn.NLLLoss()
    out = io.StringIO()
    backend = SparkBackend(num_proc=2, stdout=out, stderr=io.StringIO(),
                           prefix_output_with_timestamp=True)
    torch_estimator = hvd.TorchEstimator(
        backend=backend, store=store, model=model, optimizer=optimizer,
        loss=lambda input, target: loss(input, target.long()), input_shapes=[[-1, 1, 8, 8]],
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=15,
        validation="is_val", metrics=[accuracy], backward_passes_per_step=1, verbose=1,
        random_seed=1)
    torch_model = bounded(spark_cluster, lambda: torch_estimator.fit(train_df),
                          timeout_s=300).setOutputCols(["label_prob"])
    assert isinstance(torch_model, hvd.TorchModel)
    assert torch_model.getFeatureColumns() == ["features"]
    # the returned optimizer is the trained one, with the learning rate given (unscaled)
    assert torch_model.getOptimizer().param_groups[0]["lr"] == 0.025
    assert torch_model.getOptimizer().state   # momentum buffers came back
    history = torch_model.getHistory()
    assert len(history["loss"]) == 15 and history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    assert "[0]<stdout>:epoch 14:" in out.getvalue()   # rank 0's progress, tagged
    pred_df = torch_model.transform(test_df)
    assert bounded(spark_cluster, lambda: test_accuracy(pred_df)) >= 0.9
    # the predictions are the returned module's, computed locally
    rows = bounded(spark_cluster, lambda: pred_df.limit(20).collect())
    local = torch_model.getModel()(torch.tensor(
        np.array([r["features"].toArray() for r in rows]).reshape(-1, 1, 8, 8),
        dtype=torch.float32))
    # (a 10-value output is a Spark ML vector, as Horovod gives it)
    np.testing.assert_allclose(np.array([r["label_prob"].toArray() for r in rows]),
                               local.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert store.exists(store.get_checkpoint_path(torch_model.getRunId()))


def test_keras_estimator_as_horovods_example_uses_it(spark_cluster, tmp_path):
    import keras
    import hvdlite.spark.keras as hvd
    train_df, test_df = digits_frames(spark_cluster)
    store = Store.create(str(tmp_path))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, (3, 3), activation="relu"),
        keras.layers.MaxPooling2D((2, 2)), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")])
    keras_estimator = hvd.KerasEstimator(
        backend=SparkBackend(num_proc=2, stdout=io.StringIO(), stderr=io.StringIO()),
        store=store, model=model, optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.categorical_crossentropy, metrics=["accuracy"],
        feature_cols=["features"], label_cols=["label_vec"], batch_size=32, epochs=15,
        validation=0.2, random_seed=1, inmemory_cache_all=True, verbose=1)
    keras_model = bounded(spark_cluster, lambda: keras_estimator.fit(train_df),
                          timeout_s=300).setOutputCols(["label_prob"])
    assert isinstance(keras_model, hvd.KerasModel)
    # compiled, with the learning rate given (the ranks trained with it times 2)
    assert float(keras_model.getModel().optimizer.learning_rate) == pytest.approx(0.05)
    history = keras_model.getHistory()
    assert len(history["loss"]) == 15 and history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    pred_df = keras_model.transform(test_df)
    assert bounded(spark_cluster, lambda: test_accuracy(pred_df)) >= 0.9
    rows = bounded(spark_cluster, lambda: pred_df.limit(20).collect())
    local = keras_model.getModel().predict_on_batch(
        np.array([r["features"].toArray() for r in rows], dtype=np.float32).reshape(-1, 8, 8, 1))
    np.testing.assert_allclose(np.array([r["label_prob"].toArray() for r in rows]), local,
                               rtol=1e-4, atol=1e-5)
    labels = np.array([r["label_vec"].toArray() for r in rows])
    _, accuracy = keras_model.getModel().evaluate(
        np.array([r["features"].toArray() for r in rows]).reshape(-1, 8, 8, 1), labels,
        verbose=0)
    assert accuracy >= 0.8


class TwoInputRegression:
    """A torch module whose forward takes one argument per feature column (Horovod's rule),
    with a (batch, 1) output against a scalar label (built lazily: torch imported where it
    runs)."""

    @staticmethod
    def build():
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Linear(1, 1)
                self.b = torch.nn.Linear(1, 1, bias=False)

            def forward(self, a, b):
                return self.a(a) + self.b(b)

        torch.manual_seed(0)
        return Net()


def test_torch_regression_on_two_scalar_columns(spark_cluster, tmp_path):
    """y = 3a - 2b + 1 from the scalar columns a and b: forward(a, b) gets one tensor per
    column, the scalar label takes the (batch, 1) output's shape in the loss, and transform
    gives a double column."""
    import torch
    from pyspark.sql.types import DoubleType
    from hvdlite.spark.torch import TorchEstimator
    rng = np.random.default_rng(0)
    a, b = rng.uniform(-1, 1, 600), rng.uniform(-1, 1, 600)
    df = spark_cluster.createDataFrame(
        [(float(x), float(z), float(3 * x - 2 * z + 1)) for x, z in zip(a, b)],
        ["a", "b", "y"]).repartition(4)
    model = TwoInputRegression.build()
    fitted = bounded(spark_cluster, lambda: TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path)), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss=torch.nn.MSELoss(),
        feature_cols=["a", "b"], label_cols=["y"], batch_size=16, epochs=8, validation=0.2,
        val_batch_size=50, verbose=0).fit(df))
    history = fitted.getHistory()
    assert history["val_loss"][-1] < 1e-3, history   # (unmatched labels stall near var(y))
    trained = fitted.getModel()
    assert trained.a.weight.item() == pytest.approx(3, abs=0.05)
    assert trained.b.weight.item() == pytest.approx(-2, abs=0.05)
    out = fitted.transform(df.limit(5))
    assert isinstance(out.schema["y__output"].dataType, DoubleType)
    rows = bounded(spark_cluster, lambda: out.collect())
    local = trained(torch.tensor([[r["a"]] for r in rows]), torch.tensor([[r["b"]] for r in rows]))
    np.testing.assert_allclose([r["y__output"] for r in rows], local.detach().numpy().ravel(),
                               rtol=1e-5, atol=1e-6)


def test_estimator_parameters_are_checked(spark_cluster):
    import torch
    from hvdlite.spark.torch import TorchEstimator
    model = conv_net()
    with pytest.raises(ValueError, match="unsupported parameter.*mp_start_method"):
        TorchEstimator(model=model, mp_start_method="spawn")
    with pytest.raises(TypeError, match="unknown parameter"):
        TorchEstimator(model=model, batchsize=3)
    estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               loss=torch.nn.MSELoss(), feature_cols="features",
                               label_cols=["y"])
    with pytest.raises(ValueError, match="feature_cols must be a list"):
        estimator.check()
    assert estimator.getBatchSize() == 32 and estimator.setBatchSize(8).getBatchSize() == 8
    both = TorchEstimator(model=model, num_proc=2, backend=SparkBackend(num_proc=2))
    with pytest.raises(ValueError, match="backend or num_proc, not both"):
        both.backend()
    with pytest.raises(ValueError, match="has no column"):
        from hvdlite.spark.common.data import to_arrays
        to_arrays(spark_cluster.createDataFrame([(1.0,)], ["x"]), ["features"])
    with pytest.raises(ValueError, match="LocalStore only"):
        Store.create("hdfs://namenode/tmp")
    # fit refuses before any Spark job: no store (a /tmp default would split the data across
    # machines)
    storeless = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"])
    with pytest.raises(ValueError, match="store is required"):
        storeless.fit(spark_cluster.createDataFrame([(1.0, 2.0)], ["x", "y"]))
