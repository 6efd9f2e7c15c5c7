"""Case names of the TF training-setup worker (pure Python: pytest collects them without
importing TensorFlow)."""
from __future__ import annotations

NP_VALUES = (2, 3)

CASES = [
    "mixed_precision.compile_wraps",
    "mixed_precision.compile_wraps_eager",
    "mixed_precision.loss_scale_outside",
    "mixed_precision.loss_scale_inside",
    "mixed_precision.backward_passes",
    "mixed_precision.custom_loop_tape",
    "mixed_precision.custom_loop_optimizer",
    "none_gradients.eager_tape",
    "none_gradients.eager_sparse",
    "none_gradients.eager_keras_optimizer",
    "none_gradients.traced_alike",
    "none_gradients.traced_differently_is_an_error",
    "xla.refused_clearly",
]
