"""Horovod's elastic API is refused with a clear error in every adapter (pure Python: no MPI
launch; the names resolve without hvd.init())."""
import importlib

import pytest

ADAPTERS = ["hvdlite.torch", "hvdlite.tensorflow", "hvdlite.tensorflow.keras"]
NAMES = ["run", "State", "ObjectState", "TorchState", "TensorFlowKerasState", "ElasticSampler"]


def _adapter(name):
    pytest.importorskip("torch" if name == "hvdlite.torch" else "tensorflow")
    return importlib.import_module(name)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("attr", NAMES)
def test_elastic_names_raise_not_supported(adapter, attr):
    hvd = _adapter(adapter)
    with pytest.raises(NotImplementedError) as info:
        getattr(hvd.elastic, attr)
    message = str(info.value)
    assert f"hvd.elastic.{attr}" in message and "hvdlite run -np N" in message
    assert "checkpoint" in message


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_from_import_raises_not_supported(adapter):
    _adapter(adapter)
    with pytest.raises(NotImplementedError, match="elastic training"):
        exec(f"from {adapter}.elastic import ElasticSampler", {})


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_introspection_still_works(adapter):
    hvd = _adapter(adapter)
    assert not hasattr(hvd.elastic, "__wrapped__")   # AttributeError, not NotImplementedError
    assert hvd.elastic.__name__ == f"{adapter}.elastic"
