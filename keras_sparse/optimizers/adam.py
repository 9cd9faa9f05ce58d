"""Lazy Adam: moments of rows a batch did not touch stay where they are."""

import keras
from keras import ops

from keras_sparse.optimizers.base import SlotSpec
from keras_sparse.optimizers.base import SparseOptimizer


@keras.saving.register_keras_serializable(package="keras_sparse")
class Adam(SparseOptimizer):
    """Adam applied to touched rows only (the "lazy" variant).

    The bias correction uses the layer's global step, as keras.optimizers.Adam
    does, so when every row is touched every step the two are identical.

    Example:

    >>> import keras_sparse as ks
    >>> layer = ks.AllToAllDenseEmbedding(100, 8, optimizer=ks.optimizers.Adam(1e-3))
    """

    identifier = "adam"

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        super().__init__(learning_rate)
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(
                    f"Adam: `{name}` must be in [0, 1). Received: {name}={value}"
                )
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = float(epsilon)

    def slot_specs(self):
        return [SlotSpec("momentum"), SlotSpec("velocity")]

    def new_slots(self, rows, slots, grads, lr, iterations):
        m = slots["momentum"]
        v = slots["velocity"]
        m = m + (grads - m) * (1 - self.beta_1)
        v = v + (ops.square(grads) - v) * (1 - self.beta_2)
        return {"momentum": m, "velocity": v}

    def step_size(self, lr, iterations, dtype):
        """The bias-corrected learning rate of update ``iterations + 1``."""
        local_step = ops.cast(iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        return lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)

    def rows_from_slots(self, rows, new_slots, grads, lr, iterations):
        alpha = self.step_size(lr, iterations, rows.dtype)
        m, v = new_slots["momentum"], new_slots["velocity"]
        return rows - (m * alpha) / (ops.sqrt(v) + self.epsilon)

    def get_config(self):
        return {
            **super().get_config(),
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
        }
