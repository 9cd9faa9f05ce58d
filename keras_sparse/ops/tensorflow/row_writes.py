"""TensorFlow: the one place rows are written back into a table or slot
variable."""

import tensorflow as tf

from keras_sparse.ops.row_rounding import to_storage


def write_rows(variable, rows, values, seed=None):
    """Scatters ``values`` (float32) into ``variable[rows]`` in its dtype:
    stochastically rounded for a 16-bit variable with a ``seed``
    (`keras_sparse.ops.row_rounding`). Returns the write operation."""
    stored = to_storage(values, variable.dtype, rows, seed)
    return variable.scatter_update(tf.IndexedSlices(stored, rows))
