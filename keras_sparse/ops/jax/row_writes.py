"""JAX: the one place rows are written back into a table or slot array."""

from keras_sparse.ops.row_rounding import to_storage


def write_rows(array, rows, values, seed=None, first_row=0):
    """``array`` with ``array[rows] = values`` (float32) in its dtype:
    stochastically rounded for a 16-bit array with a ``seed``
    (`keras_sparse.ops.row_rounding`). Rows out of range are dropped.
    ``first_row``: the global row of ``array``'s row 0 (a row shard), so
    that a row draws the same bits sharded or not."""
    stored = to_storage(values, array.dtype, rows + first_row, seed)
    return array.at[rows].set(stored, mode="drop")
