"""JAX: the one place rows are written back into a table or slot array."""

from keras_sparse.ops.row_rounding import to_storage


def write_rows(array, rows, values, seed=None):
    """``array`` with ``array[rows] = values`` (float32) in its dtype:
    stochastically rounded for a 16-bit array with a ``seed``
    (`keras_sparse.ops.row_rounding`). Rows out of range are dropped."""
    stored = to_storage(values, array.dtype, rows, seed)
    return array.at[rows].set(stored, mode="drop")
