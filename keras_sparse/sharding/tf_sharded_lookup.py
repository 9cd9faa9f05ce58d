"""TensorFlow: a table sharded over the replicas of a MirroredStrategy (or
MultiWorkerMirroredStrategy: the all-gathers span the workers).

Replica ``d`` of ``D`` holds its part of the table and slots (see
`keras_sparse.sharding.tf_placement`): rows ``[d*B, (d+1)*B)`` (row
sharding, ``B = ceil(num_rows / D)``) or columns ``[d*c, (d+1)*c)`` of every
row (column sharding, ``c = dim / D``). Each replica looks up its own batch
positions (global row ids); the sparse optimizer runs on each part's owner
inside the backward pass (a ``tf.custom_gradient`` on the layer's anchor, as
`keras_sparse.ops.tensorflow.lookup`), with that module's row update.

TensorFlow's ``all_to_all`` hangs on logical CPU devices under
MirroredStrategy, so the exchanges are all-gathers (``ReplicaContext
.all_gather``; replicas may hold different batch sizes). Per step, with
``n`` ids per replica, ``T`` the ids exchanged in all (``D * n``, or the
replicas' distinct ids, see below), ``dim`` float32 columns, each replica
receives (its own part included):

* row, forward: the ids (``4 T`` bytes) and the batch sizes (``4 D``);
  each replica gathers the rows it owns for every id, compacted, and an
  all-gather of those gives every replica the ``T`` rows (``4 T dim``), in
  owner order, from which it takes its own positions.
* column, forward: the ids (``4 T``), then each replica's columns of every
  id, all-gathered along the columns (``4 T dim``).
* backward (both): the row gradients (``4 T dim``); the ids are the
  forward's. Row: each replica updates the ids it owns (local row
  ``id - d*B``); column: every id, on its own columns of the gradients.

A replicated ("data") table needs no forward exchange and ``4 D n (dim + 1)``
bytes backward (`keras_sparse.ops.tensorflow.replicas`). An all-to-all would bring
each sharded exchange down to about ``4 n dim``; it is not used here.

Each replica exchanges its DISTINCT ids once (while
`exchange_buckets.DEDUP_EXCHANGE` is on, the default; the all-gathers take
any size, so nothing can overflow): repeated positions read their id's
row, and their gradients are summed on the replica before the all-gather:
an id's gradient is the sum over the global batch grouped by replica, so
float rounding may differ from one device's in the last bits (the sharded
results equal one device's within 1e-5).
"""

import tensorflow as tf

from keras_sparse.ops.row_rounding import to_compute
from keras_sparse.ops.tensorflow import row_updates as tf_row_updates
from keras_sparse.sharding import exchange_buckets as buckets


def replica_id(context):
    """This replica's index in sync, over all workers (a Python int:
    MirroredStrategy traces each replica's step on its own)."""
    return int(tf.get_static_value(context.replica_id_in_sync_group))


class Exchange:
    """The ids of every replica and this replica's place among them."""

    def __init__(self, context, ids, valid):
        self.context = context
        self.devices = context.num_replicas_in_sync
        self.me = replica_id(context)
        marked = tf.where(valid, ids, -tf.ones_like(ids))
        self.inverse = None  # position -> its distinct id (dedup only)
        if buckets.DEDUP_EXCHANGE:
            marked, self.inverse = tf.unique(marked)
        self.size = tf.shape(marked)[0]
        # -1 marks an invalid position in the gathered ids.
        self.all_ids = context.all_gather(marked, axis=0)
        sizes = context.all_gather(self.size[None], axis=0)
        self.start = tf.reduce_sum(sizes[: self.me])

    def mine(self, rows):
        """This replica's part of ``rows`` (one per gathered id)."""
        return rows[self.start : self.start + self.size]

    def spread(self, rows):
        """One row per exchanged id -> one per local position."""
        return rows if self.inverse is None else tf.gather(rows, self.inverse)

    def combine(self, grads):
        """One gradient per local position -> one per exchanged id (summed
        in local order)."""
        if self.inverse is None:
            return grads
        return tf.math.unsorted_segment_sum(grads, self.inverse, self.size)


def row_forward(exchange, table, shard_rows):
    """``[n, dim]`` rows of this replica's ids from a row-sharded table."""
    ids = exchange.all_ids
    # Owner of each id; an invalid or out-of-range id sorts after them all.
    owner = tf.where(ids >= 0, ids // shard_rows, exchange.devices)
    owner = tf.minimum(owner, exchange.devices)
    mine = tf.equal(owner, exchange.me)
    local = tf.boolean_mask(ids, mine) - exchange.me * shard_rows
    owned = exchange.context.all_gather(tf.gather(table, local), axis=0)
    # ``owned`` lists the valid ids owner by owner, each owner's in their
    # batch order: a stable sort by owner gives the same order.
    order = tf.argsort(owner, stable=True)
    place = tf.math.invert_permutation(order)
    missing = tf.shape(ids)[0] - tf.shape(owned)[0]
    owned = tf.concat([owned, tf.zeros([missing, tf.shape(owned)[1]], owned.dtype)], 0)
    return tf.gather(owned, exchange.mine(place))


def column_forward(exchange, table):
    """``[n, dim]`` rows of this replica's ids from a column-sharded table."""
    ids = exchange.all_ids
    part = tf.gather(table, tf.where(ids >= 0, ids, tf.zeros_like(ids)))
    return exchange.mine(exchange.context.all_gather(part, axis=1))


def forward(kind, exchange, table, shard_rows):
    rows = (
        row_forward(exchange, table, shard_rows)
        if kind == "row"
        else column_forward(exchange, table)
    )
    valid = exchange.mine(exchange.all_ids) >= 0
    rows = tf.where(valid[:, None], rows, tf.zeros((), rows.dtype))
    return to_compute(exchange.spread(rows))


def owned_update(kind, exchange, grads, shard_rows, columns):
    """``(ids, valid, grads)`` of the global batch this replica's part
    applies: local row numbers and, for columns, its own columns."""
    ids = exchange.all_ids
    all_grads = exchange.context.all_gather(exchange.combine(grads), axis=0)
    if kind == "row":
        first = exchange.me * shard_rows
        valid = (ids >= first) & (ids < first + shard_rows)
        return ids - first, valid, all_grads
    first = exchange.me * columns
    return ids, ids >= 0, all_grads[:, first : first + columns]


def sharded_lookup(kind, context, state, anchor, optimizer, ids, valid, iterations,
                   constraint, stochastic=True):  # fmt: skip
    """Rows of ``ids`` (this replica's flat positions, global row ids).

    ``state``: ``{"table": this replica's part, slot name: its part}``
    (tf.Variables). ``iterations`` None: a plain gather (no update). The
    backward pass of the returned rows updates the owners' parts.
    """
    exchange = Exchange(context, tf.cast(ids, tf.int32), tf.cast(valid, tf.bool))
    table = state["table"]
    local_rows, columns = int(table.shape[0]), int(table.shape[1])
    if iterations is None:
        return forward(kind, exchange, table, local_rows)

    @tf.custom_gradient
    def lookup(anchor):
        out = forward(kind, exchange, table, local_rows)

        def grad(upstream):
            step_ids, step_valid, grads = owned_update(
                kind, exchange, tf.convert_to_tensor(upstream), local_rows, columns
            )
            writes = tf_row_updates.apply_row_updates(
                state, optimizer, step_ids, step_valid, grads, iterations,
                local_rows, constraint, None, stochastic,
            )  # fmt: skip
            # As `ops.tensorflow.lookup`: the zero gradient depends on the
            # written data, which Grappler keeps.
            with tf.control_dependencies(writes):
                probe = tf.reduce_sum(table[:1])
            return tf.math.multiply_no_nan(
                tf.cast(probe, anchor.dtype), tf.zeros_like(anchor)
            )

        return out, grad

    return lookup(anchor)
