"""TensorFlow: the sparse update rides on a tf.custom_gradient.

Table and slots are non-trainable variables. A scalar trainable "anchor"
variable is the function's only differentiable input, so the tape calls the
gradient function, which scatter-updates the touched rows in place and
returns a zero gradient for the anchor. Under tf.distribute.MirroredStrategy
every replica applies the update of the global batch (see
`keras_sparse.ops.tensorflow.replicas`).
"""

import tensorflow as tf

from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.row_rounding import write_seed
from keras_sparse.ops.row_updates import TableBlocks
from keras_sparse.ops.row_updates import compute_row_updates
from keras_sparse.ops.row_updates import fill_unused_entries
from keras_sparse.ops.row_updates import number_representatives
from keras_sparse.ops.row_updates import scratch_keys
from keras_sparse.ops.tensorflow import native_rows as tf_native_rows
from keras_sparse.ops.tensorflow import replicas as tf_replicas
from keras_sparse.ops.tensorflow import row_updates as tf_row_updates
from keras_sparse.ops.tensorflow.row_writes import write_rows

# Scales a layer's row-regularizer penalty (see `tf_replicas.replica_count`).
replica_count = tf_replicas.replica_count
# Refuses, before any state changes, what replicas cannot train exactly.
check_replicated_training = tf_replicas.check_replicated_training


def _tf_variable(var):
    value = var.value
    return value if isinstance(value, tf.Variable) else var._value


def gather_valid(table, ids, valid):
    """``table[ids]`` where ``valid``, else zero rows (float32 from a
    16-bit table)."""
    rows = tf.gather(table, tf.where(valid, ids, tf.zeros_like(ids)))
    return to_compute(tf.where(valid[:, None], rows, tf.zeros((), rows.dtype)))


def reset_rows(state, optimizer, ids, mask, values):
    """Scatter-assigns ``values[mask]`` to rows ``ids[mask]``, slots to initial.

    Not XLA-compilable (boolean_mask); used only by layers that run without
    XLA. Later reads of the variables are ordered after these writes by
    tf.function's automatic control dependencies.
    """
    rows = tf.boolean_mask(ids, mask)
    write_rows(state["table"], rows, tf.boolean_mask(values, mask))
    for spec in optimizer.slot_specs():
        var = state[spec.name]
        fill = tf.fill(tf.stack([tf.shape(rows)[0], var.shape[1]]), spec.initial_value)
        write_rows(var, rows, fill)


def scratch_segments(scratch_var, ids, valid, num_rows):
    """`row_updates.scratch_segments` writing the scratch variable in place.

    None outside XLA: there the update dedups with ``tf.unique`` instead
    (`keras_sparse.ops.tensorflow.row_updates`), cheaper than a graph's cumsum.
    """
    if not tf_row_updates.in_xla():
        return None
    variable = _tf_variable(scratch_var)
    keys = scratch_keys(ids, valid, num_rows)
    position = tf.range(tf.shape(keys)[0], dtype=tf.int32)
    # Automatic control dependencies order the accesses of the variable.
    variable.scatter_nd_update(keys[:, None], position)
    representative = tf.gather(variable, keys)
    return number_representatives(representative)


def _static_shape_update(
    state, optimizer, ids, valid, grads, iterations, num_rows, constraint, segments,
    stochastic,
):  # fmt: skip
    """The XLA-compilable update: ``(writes, written indices)``."""

    def gather(name, rows):
        return tf.gather(state[name], rows)

    slot_names = tuple(name for name in state if name != "table")
    unique_ids, is_real, new_values = compute_row_updates(
        optimizer, gather, slot_names, ids, valid, grads, iterations,
        num_rows, constraint, segments,
    )  # fmt: skip
    old_first = {
        name: tf.gather(state[name], tf.zeros((1,), tf.int32)) for name in state
    }
    indices, filled = fill_unused_entries(unique_ids, is_real, new_values, old_first)
    writes = [
        write_rows(
            state[name], indices, filled[name],
            write_seed(iterations, name, stochastic),
        )
        for name in state
    ]  # fmt: skip
    return writes, indices


def _fused_update(
    state, optimizer, ids, valid, grads, iterations, first, rows, constraint,
    segments, stochastic=True,
):  # fmt: skip
    """`tf_native_rows.fused_update`; with the input stage's ``segments``,
    of the distinct ids they number (each once, so the op's own dedup
    changes nothing), so that a batch trains alike with or without the
    stage."""
    if segments is not None:
        ids, grads = tf_row_updates.distinct_sums(ids, valid, grads, rows, segments)
        valid = tf.ones_like(ids, tf.bool)
    return tf_native_rows.fused_update(
        state, optimizer, ids, valid, grads, iterations, first, rows, constraint,
        stochastic,
    )  # fmt: skip


def lookup(state: TableState, batch: LookupBatch):
    """``batch.reset=(mask, values)``: see `reset_rows` (applied before the
    gather).

    ``batch.segments``: see `keras_sparse.ops.row_updates.compute_row_updates`.
    ``batch.blocks``: ``(batch_major, extents, row_ranges)`` of a stack of
    tables, updated table by table outside XLA (see
    `keras_sparse.ops.row_updates.TableBlocks`). A lookup with
    ``iterations`` always updates (``apply_update`` is JAX's);
    ``exchange_slot`` is not used.
    """
    table_var, optimizer, constraint = (
        state.table_var,
        state.optimizer,
        state.constraint,
    )
    reset, segments, iterations = batch.reset, batch.segments, batch.iterations
    blocks = None if batch.blocks is None else TableBlocks(*batch.blocks)
    replicas = tf_replicas.replica_context(table_var, reset)
    if replicas is not None:
        segments = None  # they number one replica's ids, not the gathered ones
        if blocks is not None and not blocks.batch_major:
            blocks = None  # the gathered batch repeats the table order
    variables = {"table": _tf_variable(table_var)}
    variables.update({n: _tf_variable(v) for n, v in state.slot_vars.items()})
    ids = tf.cast(batch.ids, tf.int32)
    valid = tf.cast(batch.valid, tf.bool)
    num_rows = int(table_var.shape[0])
    if reset is not None:
        reset_rows(variables, optimizer, ids, tf.cast(reset[0], tf.bool), reset[1])

    @tf.custom_gradient
    def gather_with_update(anchor):
        out = None
        if replicas is None and not tf_row_updates.in_xla():
            out = tf_native_rows.gather_rows(variables["table"], ids, valid)
        if out is None:
            out = gather_valid(variables["table"], ids, valid)

        def grad(upstream):
            step_ids, step_valid, grads = ids, valid, tf.convert_to_tensor(upstream)
            if replicas is not None:
                step_ids, step_valid, grads = tf_replicas.gather_batch(
                    replicas, ids, valid, grads
                )
            if tf_row_updates.in_xla():
                # One update over the stack: XLA would serialize per-table
                # writes into one variable.
                writes, indices = _static_shape_update(
                    variables, optimizer, step_ids, step_valid, grads, iterations,
                    num_rows, constraint, segments, state.stochastic_rounding,
                )  # fmt: skip
            else:
                if blocks is None or segments is not None:
                    parts = [(step_ids, step_valid, grads, 0, num_rows)]
                else:
                    parts = blocks.split(step_ids, step_valid, grads)
                writes = []
                for part_ids, part_valid, part_grads, first, end in parts:
                    fused = None
                    if replicas is None:
                        fused = _fused_update(
                            variables, optimizer, part_ids, part_valid, part_grads,
                            iterations, first, end - first, constraint, segments,
                            state.stochastic_rounding,
                        )  # fmt: skip
                    writes += [fused] if fused is not None else (
                        tf_row_updates.apply_row_updates(
                            variables, optimizer, part_ids + first, part_valid,
                            part_grads, iterations, num_rows, constraint, segments,
                            state.stochastic_rounding,
                        )
                    )  # fmt: skip
                indices = tf.zeros((1,), tf.int32)
            # Grappler prunes control-only dependencies here, so the zero
            # gradient is made to depend on the written data itself.
            with tf.control_dependencies(writes):
                probe = tf.reduce_sum(tf.gather(variables["table"], indices[:1]))
            return tf.math.multiply_no_nan(
                tf.cast(probe, anchor.dtype), tf.zeros_like(anchor)
            )

        return out, grad

    return gather_with_update(tf.convert_to_tensor(_tf_variable(state.anchor_var)))


#: Read when a step is traced: False sends pooled bags down `lookup` and
#: the layer's combiner (the benchmarks and tests compare the two).
BAG_SUMS = True
#: Combiners whose bags `bag_sums_with_sparse_update` serves in a traced
#: step, where no host check can see every id valid: it pools the valid
#: rows only, which a sum of the bag equals; a mean would divide by the
#: bag's size, not its count of valid ids.
TRACED_BAG_COMBINERS = ("sum",)


def bag_sums_apply(table_var, bags, valids):
    """Whether `bag_sums_with_sparse_update` serves a call: bags of ids
    (``[batch, bag]`` each, the bag's size known) of a float32 table of this
    process's CPU, one replica, outside XLA; eagerly, every id valid (a
    traced step: see `TRACED_BAG_COMBINERS`)."""
    table = _tf_variable(table_var)
    if not BAG_SUMS or table.dtype != tf.float32 or len(table.shape) != 2:
        return False
    if not tf_native_rows.local_cpu(table.device) or tf_row_updates.in_xla():
        return False
    if (
        tf.distribute.has_strategy()
        and tf_replicas.replica_context(table_var, None) is not None
    ):
        return False
    if any(len(b.shape) != 2 or not b.shape[1] for b in bags):
        return False
    return not tf.executing_eagerly() or all(
        bool(tf.reduce_all(tf.cast(v, tf.bool))) for v in valids
    )


def bag_sums_with_sparse_update(
    state: TableState, bags, iterations, row_ranges=None, valids=None
):
    """``[sum of batch_t, dim]``: the sums of each bag's valid rows, bag
    after bag.

    ``bags``: ``[batch_t, bag_t]`` ids (``valids``: where valid; None: all),
    one per table of a stack (``row_ranges``, its tables' rows; None: one
    table, the whole variable) with the table's first row added. The rows
    are gathered and summed as `lookup` and the sum combiner do, to the
    bit; the backward pass updates each table's touched rows from the
    bags' pooled gradient (`tf_native_rows.fused_update` with ``bag``),
    never expanding it to one row per position (a tile and a select per
    table, the larger part of a step on the CPU).
    """
    variables = {"table": _tf_variable(state.table_var)}
    variables.update({n: _tf_variable(v) for n, v in state.slot_vars.items()})
    table = variables["table"]
    num_rows, dim = int(table.shape[0]), int(table.shape[1])
    ranges = row_ranges or [(0, num_rows)]
    bags = [tf.cast(b, tf.int32) for b in bags]
    if valids is None:
        valids = [tf.ones_like(b, tf.bool) for b in bags]
    flat = [
        (tf.reshape(b, [-1]), tf.reshape(tf.cast(v, tf.bool), [-1]), int(b.shape[1]))
        for b, v in zip(bags, valids)
    ]

    @tf.custom_gradient
    def sums_with_update(anchor):
        parts = []
        for ids, valid, bag in flat:
            sums = tf_native_rows.gather_sums(table, ids, valid, bag)
            if sums is None:
                rows = tf_native_rows.gather_rows(table, ids, valid)
                if rows is None:
                    rows = gather_valid(table, ids, valid)
                sums = tf.reduce_sum(tf.reshape(rows, [-1, bag, dim]), axis=1)
            parts.append(sums)
        out = parts[0] if len(parts) == 1 else tf.concat(parts, 0)

        def grad(upstream):
            upstream = tf.convert_to_tensor(upstream)
            sizes = [tf.shape(ids)[0] // bag for ids, _, bag in flat]
            grads = tf.split(upstream, sizes) if len(flat) > 1 else [upstream]
            writes = []
            for (ids, valid, bag), g, (first, end) in zip(flat, grads, ranges):
                fused = tf_native_rows.fused_update(
                    variables, state.optimizer, ids - first, valid, g, iterations,
                    first, end - first, state.constraint, state.stochastic_rounding,
                    bag=bag,
                )  # fmt: skip
                writes += [fused] if fused is not None else (
                    tf_row_updates.apply_row_updates(
                        variables, state.optimizer, ids, valid,
                        tf.repeat(g, bag, axis=0), iterations, num_rows,
                        state.constraint, None, state.stochastic_rounding,
                    )
                )  # fmt: skip
            with tf.control_dependencies(writes):
                probe = tf.reduce_sum(tf.gather(table, tf.zeros((1,), tf.int32)))
            return tf.math.multiply_no_nan(
                tf.cast(probe, anchor.dtype), tf.zeros_like(anchor)
            )

        return out, grad

    return sums_with_update(tf.convert_to_tensor(_tf_variable(state.anchor_var)))
