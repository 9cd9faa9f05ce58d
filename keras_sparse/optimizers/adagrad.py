"""Adagrad on touched rows, with the same update as keras.optimizers.Adagrad."""

import keras
from keras import ops

from keras_sparse.optimizers.base import SlotSpec
from keras_sparse.optimizers.base import SparseOptimizer


@keras.saving.register_keras_serializable(package="keras_sparse")
class Adagrad(SparseOptimizer):
    """Per-element Adagrad: ``acc += g**2; row -= lr * g / sqrt(acc + eps)``.

    Example:

    >>> import keras_sparse as ks
    >>> opt = ks.optimizers.Adagrad(0.05, initial_accumulator_value=0.1)
    >>> layer = ks.AllToAllDenseEmbedding(100, 8, optimizer=opt)
    """

    identifier = "adagrad"

    def __init__(
        self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7
    ):
        super().__init__(learning_rate)
        if initial_accumulator_value < 0:
            raise ValueError(
                "Adagrad: `initial_accumulator_value` must be >= 0. "
                f"Received: {initial_accumulator_value}"
            )
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.epsilon = float(epsilon)

    def slot_specs(self):
        return [SlotSpec("accumulator", self.initial_accumulator_value)]

    def new_slots(self, rows, slots, grads, lr, iterations):
        return {"accumulator": slots["accumulator"] + ops.square(grads)}

    def rows_from_slots(self, rows, new_slots, grads, lr, iterations):
        return rows - lr * grads / ops.sqrt(new_slots["accumulator"] + self.epsilon)

    def get_config(self):
        return {
            **super().get_config(),
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
        }
