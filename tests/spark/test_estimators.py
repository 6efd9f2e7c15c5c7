"""The Spark ML estimators fit sklearn's digits from a DataFrame on local-cluster[2,1,1024]
(two executor JVMs, two ranks) and their models transform DataFrames."""
from __future__ import annotations

import numpy as np
import pytest

from tests.spark.conftest import bounded, require_spark

require_spark()   # (at collection: skips or fails the module)
from hvdlite.spark.common.store import LocalStore  # noqa: E402
from hvdlite.spark.torch import TorchEstimator, TorchModel  # noqa: E402


def digits_frames(spark):
    """(train, test) DataFrames: a 64-value "features" vector column (scaled to [0, 1]), a
    "label" column and a "is_val" column marking a fifth of the training rows."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    train = spark.createDataFrame(
        [(Vectors.dense(f), int(label), i % 5 == 0) for i, (f, label)
         in enumerate(zip(x_train, y_train))], ["features", "label", "is_val"])
    test = spark.createDataFrame([(Vectors.dense(f), int(label)) for f, label
                                  in zip(x_test, y_test)], ["features", "label"])
    return train.repartition(4), test


class DigitsNet:
    """A small MLP (built lazily: torch is imported only where it runs)."""

    @staticmethod
    def build():
        import torch
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 10))


def accuracy(output, label) -> float:
    return float((output.argmax(dim=1) == label).float().mean())


def test_torch_estimator_fits_digits_and_its_model_transforms(spark_cluster, tmp_path):
    import torch
    train, test = digits_frames(spark_cluster)
    model = DigitsNet.build()
    estimator = TorchEstimator(
        num_proc=2, store=LocalStore(str(tmp_path)), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy], feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=12, validation="is_val", random_seed=1,
        verbose=0)
    fitted = bounded(spark_cluster, lambda: estimator.fit(train))
    assert isinstance(fitted, TorchModel)
    history = fitted.getHistory()
    assert len(history["loss"]) == 12 and history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    predicted = bounded(spark_cluster, lambda: fitted.transform(test).collect())
    assert len(predicted) == test.count()
    outputs = np.array([row["label__output"] for row in predicted])
    labels = np.array([row["label"] for row in predicted])
    assert outputs.shape == (len(labels), 10)
    assert (outputs.argmax(axis=1) == labels).mean() >= 0.9
    # the same numbers as the returned module computes locally
    local = fitted.getModel()(torch.tensor(np.array([row["features"].toArray() for row in
                                                     predicted[:20]]), dtype=torch.float32))
    np.testing.assert_allclose(outputs[:20], local.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_estimator_parameters_are_checked():
    import torch
    model = DigitsNet.build()
    with pytest.raises(ValueError, match="unsupported parameter.*use_gpu"):
        TorchEstimator(model=model, use_gpu=True)
    with pytest.raises(TypeError, match="unknown parameter"):
        TorchEstimator(model=model, batchsize=3)
    estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                               loss=torch.nn.MSELoss(), feature_cols="features",
                               label_cols=["y"])
    with pytest.raises(ValueError, match="feature_cols must be a list"):
        estimator.check()
    assert estimator.getBatchSize() == 32 and estimator.setBatchSize(8).getBatchSize() == 8


def test_keras_estimator_fits_digits_and_its_model_transforms(spark_cluster, tmp_path):
    import keras
    from hvdlite.spark.keras import KerasEstimator, KerasModel
    train, test = digits_frames(spark_cluster)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    estimator = KerasEstimator(
        num_proc=2, store=LocalStore(str(tmp_path)), model=model,
        optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=12,
        validation=0.2, random_seed=1, verbose=0)
    fitted = bounded(spark_cluster, lambda: estimator.fit(train))
    assert isinstance(fitted, KerasModel)
    history = fitted.getHistory()
    assert len(history["loss"]) == 12 and history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    predicted = bounded(spark_cluster, lambda: fitted.transform(test).collect())
    outputs = np.array([row["label__output"] for row in predicted])
    labels = np.array([row["label"] for row in predicted])
    assert outputs.shape == (len(labels), 10)
    assert (outputs.argmax(axis=1) == labels).mean() >= 0.9
    local = fitted.getModel().predict_on_batch(
        np.array([row["features"].toArray() for row in predicted[:20]], dtype=np.float32))
    np.testing.assert_allclose(outputs[:20], local, rtol=1e-4, atol=1e-5)
