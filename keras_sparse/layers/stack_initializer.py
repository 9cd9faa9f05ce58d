"""StackInitializer: draws the tables of an `EmbeddingCollection`'s stacked
variable, each with its own initializer, at its offset in the stack."""

import keras
import numpy as np
from keras import ops


class StackInitializer:
    """Draws each table of a stack with its own initializer, in table order,
    and places it at its offset; padding rows are zeros.

    A table gets exactly the values a standalone layer of its shape would
    draw, whatever the stacking (placement, device count).
    """

    def __init__(self, parts, dim):
        self.parts = list(parts)  # (offset, rows, initializer), table order
        self.dim = int(dim)

    def __call__(self, shape, dtype=None):
        backend = keras.backend.backend()
        if backend in ("torch", "tensorflow"):
            return self._fill_in_place(shape, dtype, backend)
        drawn = [
            (offset, init((rows, self.dim), dtype=dtype))
            for offset, rows, init in self.parts
        ]
        if len(drawn) == 1 and drawn[0][0] == 0 and shape[0] == self.parts[0][1]:
            return drawn[0][1]  # one table, no padding: nothing to join
        drawn.sort(key=lambda item: item[0])
        pieces, position = [], 0
        for offset, values in drawn:
            if offset > position:
                pieces.append(ops.zeros((offset - position, self.dim), dtype))
            pieces.append(values)
            position = offset + int(values.shape[0])
        if shape[0] > position:
            pieces.append(ops.zeros((shape[0] - position, self.dim), dtype))
        return ops.concatenate(pieces, axis=0)

    def assign_to(self, variable):
        """Draws the tables into ``variable`` (built as zeros) slice by
        slice: TensorFlow copies an initial value into a new variable, so
        drawing into the variable itself holds one table at a time, not the
        stack twice."""
        for offset, rows, init in self.parts:
            values = init((rows, self.dim), dtype=variable.dtype)
            variable.value[offset : offset + rows].assign(values)

    def _fill_in_place(self, shape, dtype, backend):
        """The stack drawn table by table into one buffer (a torch tensor,
        or a NumPy array TensorFlow's variable adopts), so building it
        holds the stack plus one table, not the stack twice."""
        stack = None
        for offset, rows, init in self.parts:
            values = init((rows, self.dim), dtype=dtype)
            if backend == "torch":
                if stack is None:
                    stack = values.new_zeros(tuple(shape))
                stack[offset : offset + rows].copy_(values)
            else:
                values = ops.convert_to_numpy(values)
                if stack is None:
                    stack = np.zeros(tuple(shape), values.dtype)
                stack[offset : offset + rows] = values
            del values
        return stack


def assigns_stacks_in_place():
    """Whether stacks are drawn into their variables after building them
    (TensorFlow outside a tf.distribute strategy; see
    `StackInitializer.assign_to`)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.distribute.has_strategy()
