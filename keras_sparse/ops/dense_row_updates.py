"""The sparse update over the whole table, for steps that touch most of it.

The sparse route (`keras_sparse.ops.row_updates.compute_row_updates`) finds
the distinct ids of a step (a sort or the dedup scratch), sums their
gradients, gathers their rows and slots and scatters the results back: work
proportional to the ids. When a step holds as many ids as the table has
rows (100 bag fields of 10 ids over 8,192 rows at batch 4,096: 40,960 ids
per table), that bookkeeping costs more than updating the whole table, as a
dense optimizer does (2.1x the step of keras.layers.Embedding with dense
Adam on a CPU, 2.25x on an H200).

The dense route sums the gradients into a ``[rows, dim]`` buffer by one
scatter-add (no sort), counts the valid ids per row, runs the same
optimizer math on every row and keeps the result only where a row was
touched. It is the same lazy update: untouched rows and their slots keep
their exact bits, and touched rows get the same gradient sums (a
scatter-add in position order, as the sparse route's segment sum) and the
same element-wise math. That math is compiled into other loops, so a few
elements may differ from the sparse route's in the last bit (XLA:CPU
contracts some multiply-adds differently).
"""

import keras
from keras import ops

from keras_sparse.ops.row_rounding import is_sixteen_bit
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.row_rounding import to_storage
from keras_sparse.ops.row_rounding import write_seed

# None: decide by shapes (`uses_dense_route`); True/False force a route
# (tests compare both on any machine).
FORCE_DENSE_ROUTE = None

# The dense route runs when ids >= rows / ROWS_PER_ID[device]. Measured
# with `benchmarks/dense_route.py` (one table's backward, sparse Adam, 8,192
# to 1e6 rows, uniform and Zipf ids): the dense route costs a scatter-add of
# the ids plus element-wise math over every row, the sparse route a dedup of
# the ids plus gathers and scatters of the rows they touch.
# - XLA:CPU (dim 4 and 32): the sparse route wins up to ids = rows / 4 by
#   skipping the untouched rows (2-4x at rows / 16), the routes break even
#   near rows / 2 (0.7-2x either way) and the dense route wins from ids =
#   rows on (1.2-5x; 3x at the demo's 5 ids per row).
# - H200: the sort and the launches of the sparse route cost more, so the
#   dense route wins from rows / 4 on (1.1-2.2x; 1.4x at 5 ids per row)
#   and the two are even at rows / 16.
# - The compiled call (`ops.jax.native_rows`, taken on a CPU below the
#   threshold): at 1e5 rows 0.5-0.6 ms for rows / 4 ids against 0.9-1.2
#   ms for either XLA route; from ids = rows on the dense route wins again
#   (1.4-2.8 ms against 3.3 ms), its pass over the table being cheaper
#   than hashing every id.
ROWS_PER_ID = {"cpu": 1, "accelerator": 4}


def rows_per_id():
    import jax

    return ROWS_PER_ID["cpu" if jax.default_backend() == "cpu" else "accelerator"]


def uses_dense_route(num_ids, num_rows, constraint=None):
    """Whether a step of ``num_ids`` ids updates its ``num_rows`` rows densely.

    A static decision from shapes (at trace time). JAX only, without a
    `keras.distribution` (a distributed step keeps the sparse route: its
    sums over devices would add in another order) and without an
    ``embeddings_constraint`` (Keras constraints may depend on the set of
    rows they see, e.g. ``MaxNorm(axis=0)``).
    """
    if keras.backend.backend() != "jax" or constraint is not None:
        return False
    if keras.distribution.distribution() is not None:
        return False
    if FORCE_DENSE_ROUTE is not None:
        return bool(FORCE_DENSE_ROUTE)
    if not isinstance(num_ids, int):
        return False
    return num_ids * rows_per_id() >= num_rows


def dense_row_updates(optimizer, state, ids, valid, grads, iterations, stochastic=True):
    """``state`` (``"table"`` and slots, full arrays) after one lazy update.

    Args:
        optimizer: a `keras_sparse.optimizers.SparseOptimizer`.
        state: dict ``"table"`` and each slot name -> ``[rows, width]``.
        ids: ``[N]`` int row ids; invalid positions may hold anything.
        valid: ``[N]`` bool, False for padding and out-of-range ids.
        grads: ``[N, dim]`` gradient of each looked-up vector.
        iterations: updates applied before this one.
        stochastic: whether 16-bit arrays round stochastically
            (`keras_sparse.ops.row_rounding`).

    Returns:
        A dict like ``state``: touched rows (and their slots) updated, the
        others exactly as they were.
    """
    stored = state
    table = to_compute(state["table"])
    num_rows = table.shape[0]
    summed, touched = _sum_by_row(ids, valid, grads, num_rows)
    slots = {name: to_compute(v) for name, v in state.items() if name != "table"}
    keep = ops.expand_dims(touched, -1)
    every_row = ops.arange(num_rows, dtype="int32")

    def kept(new, old, name):
        # Rounded by row as the sparse route rounds them: same bits.
        seed = write_seed(iterations, name, stochastic)
        old = stored[name]
        return ops.where(keep, to_storage(new, old.dtype, every_row, seed), old)

    # The rows from 16-bit stored slots would differ from the sparse
    # route's (from the float32 ones): those take the plain update.
    if optimizer.splits_update() and all(
        not is_sixteen_bit(v.dtype) for v in state.values()
    ):
        # Rows from the stored slots: each slot is then written in place
        # before the rows read it. From the old slots, XLA:CPU recomputed
        # the new ones inside the rows' loop and so copied every slot first
        # (Adam at 1e5 x 32 rows: 22 ms, 8 ms this way).
        new_rows, new_slots = optimizer.update_slots_then_rows(
            table, slots, summed, iterations, kept
        )
    else:
        new_rows, new_slots = optimizer.update(table, slots, summed, iterations)
        new_slots = {name: kept(v, slots[name], name) for name, v in new_slots.items()}
    return {"table": kept(new_rows, table, "table"), **new_slots}


def _sum_by_row(ids, valid, grads, num_rows):
    """``([rows, dim] gradient sums, [rows] touched)`` by scatter-adds.

    Invalid positions add a zero gradient to row 0 and no count: ``x + 0``
    is ``x``, so row 0's sum keeps the bits of the sparse route's. (The
    counts riding as an extra gradient column, one scatter, measured no
    faster on an H200 and costs a ``[n, dim + 1]`` copy.)
    """
    safe_ids = ops.where(valid, ops.cast(ids, "int32"), 0)
    grads = ops.where(ops.expand_dims(valid, -1), grads, ops.zeros_like(grads))
    summed = ops.segment_sum(grads, safe_ids, num_segments=num_rows)
    counts = ops.segment_sum(ops.cast(valid, "int32"), safe_ids, num_segments=num_rows)
    return summed, ops.greater(counts, 0)
