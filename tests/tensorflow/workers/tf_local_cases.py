"""Case names of the TF model-parallel (local variables) / object / checkpoint worker (pure
Python: pytest collects them without importing TensorFlow)."""
from __future__ import annotations

NP_VALUES = (2, 3)

CASES = [
    "tape.partial_eager",
    "tape.partial_graph",
    "tape.register_local_source_unscaled",
    "tape.partial_without_local_layers",
    "tape.local_layers_rejected",
    "keras.partial_apply",
    "keras.partial_backward_passes",
    "keras.partial_fit",
    "keras.broadcast_skips_local",
    "objects.broadcast_object_fn",
    "objects.process_set",
    "keras.best_model_checkpoint",
]
