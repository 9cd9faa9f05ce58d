"""TensorFlow without XLA: the sparse row update as a dozen graph operations.

Keras compiles TensorFlow steps without XLA on CPU-only machines (its
``jit_compile="auto"``), and a plain graph has dynamic shapes: the update
then runs on exactly the distinct rows, found by ``tf.unique`` (a hash,
O(n)), with no size buckets, no padding and no sort. The backend-neutral
`keras_sparse.ops.row_updates` path (static shapes) stays for XLA.
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.tensorflow.row_writes import write_rows


def in_xla():
    """Whether the graph being built is compiled by XLA (jit_compile=True)."""
    if tf.executing_eagerly():
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def apply_row_updates(
    state, optimizer, ids, valid, grads, iterations, num_rows, constraint, segments,
    stochastic=True,
):  # fmt: skip
    """Sums duplicate ids' gradients and scatters their new rows and slots.

    Args:
        state: ``{"table": tf.Variable, slot name: tf.Variable}``.
        optimizer: a `keras_sparse.optimizers.SparseOptimizer`.
        ids, valid, grads: ``[n]`` int32 ids, ``[n]`` bool, ``[n, dim]``.
        iterations: updates applied before this one.
        num_rows: rows of the table (the key of invalid positions).
        constraint: optional callable applied to the new rows.
        segments: optional ``[n]`` dense numbering of the distinct keys from
            the input stage; replaces ``tf.unique``.
        stochastic: whether 16-bit arrays round stochastically
            (`keras_sparse.ops.row_rounding`).

    Returns:
        The list of write operations.
    """
    unique, summed = distinct_sums(ids, valid, grads, num_rows, segments)
    # The optimizer's math runs in float32 for 16-bit arrays too.
    slots = {name: to_compute(tf.gather(var, unique)) for name, var in state.items()}
    rows = slots.pop("table")
    new_rows, new_slots = optimizer.update(rows, slots, summed, iterations)
    if constraint is not None:
        new_rows = constraint(new_rows)
    return [
        write_rows(
            state[name], unique, values, write_seed(iterations, name, stochastic)
        )
        for name, values in {"table": new_rows, **new_slots}.items()
    ]


def distinct_sums(ids, valid, grads, num_rows, segments=None):
    """``(unique, summed)``: the distinct valid ids and their gradients
    summed, by ``tf.unique`` or by the input stage's ``segments``."""
    keys = tf.where(valid, ids, num_rows)
    if segments is None:
        unique, inverse = tf.unique(keys, out_idx=tf.int32)
    else:
        inverse = tf.cast(segments, tf.int32)
        count = tf.reduce_max(tf.concat([inverse, [-1]], 0)) + 1  # 0 if empty
        unique = tf.tensor_scatter_nd_update(
            tf.fill([count], num_rows), inverse[:, None], keys
        )
    summed = tf.math.unsorted_segment_sum(grads, inverse, tf.size(unique))
    real = unique < num_rows
    return tf.boolean_mask(unique, real), tf.boolean_mask(summed, real)
