"""Row-wise Adagrad: one accumulator per embedding row."""

import keras
from keras import ops

from keras_sparse.optimizers.adagrad import Adagrad
from keras_sparse.optimizers.base import SlotSpec


@keras.saving.register_keras_serializable(package="keras_sparse")
class RowWiseAdagrad(Adagrad):
    """Adagrad with a single accumulator per row (the mean of ``g**2``).

    It keeps ``dim`` times less optimizer state than `Adagrad`, which matters
    when the table is most of the model.

    Example:

    >>> import keras_sparse as ks
    >>> layer = ks.AllToAllDenseEmbedding(
    ...     100, 8, optimizer=ks.optimizers.RowWiseAdagrad(0.05))
    """

    identifier = "rowwise_adagrad"

    def slot_specs(self):
        return [SlotSpec("accumulator", self.initial_accumulator_value, row_wise=True)]

    def new_slots(self, rows, slots, grads, lr, iterations):
        acc = slots["accumulator"] + ops.mean(ops.square(grads), axis=-1, keepdims=True)
        return {"accumulator": acc}

    def rows_from_slots(self, rows, new_slots, grads, lr, iterations):
        return rows - lr * grads / ops.sqrt(new_slots["accumulator"] + self.epsilon)
