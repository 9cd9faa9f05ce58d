"""Row- and column-sharded tables under tf.distribute.MirroredStrategy
(and MultiWorkerMirroredStrategy: each worker holds its own replicas' parts,
`keras_sparse.ops.tensorflow.workers`).

A layer built under ``strategy.scope()`` with ``sharding="row"`` or
``"column"`` and a sparse optimizer gets a `TfShardedPlacement`: its table
and slots are per-replica variables (``synchronization="on_read"``, one
independent component per replica, `ReplicaPartVariable`) holding replica
``d``'s part only, rows ``[d*B, (d+1)*B)`` with ``B = ceil(num_rows / D)``
(zero padding rows at the end) or columns ``[d*dim/D, (d+1)*dim/D)`` of
every row. The parts are cut from one draw of the whole table, so a seeded
model starts as on one device. Lookups run `tf_sharded_lookup` (the bytes
each exchange moves are stated there). Saved state is the whole unpadded
table (device-count independent files); ``get_weights`` gives it too.

"data" and "auto" keep one replicated copy per replica ("table" needs an
EmbeddingCollection and raises) (`keras_sparse.ops.tensorflow.replicas`). Hash
layers are key-sharded (`tf_key_placement`); EmbeddingCollection tables are
sharded by `keras_sparse.sharding.tf_stacks`. Across workers
(MultiWorkerMirroredStrategy), whole values (saves, ``get_weights``, a call
outside a step) are all-gathered: every worker must ask for them together.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState
from keras_sparse.ops.tensorflow import row_updates as tf_row_updates
from keras_sparse.ops.tensorflow import workers as tf_workers
from keras_sparse.ops.tensorflow.lookup import _tf_variable
from keras_sparse.ops.tensorflow.lookup import gather_valid
from keras_sparse.sharding import tf_sharded_lookup

STRATEGIES = ("row", "column")


def build_placement(layer):
    """The `TfShardedPlacement` ``layer`` is built with, or None (a local
    or replicated table): row or column sharding of a fixed-vocabulary
    layer under a (MultiWorker)MirroredStrategy of several replicas."""
    wanted = STRATEGIES + ("table",)
    if layer.sharding not in wanted or layer.keras_sparse_kind != "fixed":
        return None
    active = tf_workers.several_replicas()
    if active is None:
        return None
    strategy, replicas, where = active
    head = f"Layer '{layer.name}': sharding={layer.sharding!r} under {where}"
    if layer.sharding == "table":
        raise ValueError(
            f"{head} needs the table in an EmbeddingCollection (which stacks "
            "each replica's whole tables into one row-sharded variable). Put "
            "it in an EmbeddingCollection, or use 'row', 'column' or 'data' "
            "(a full copy per replica)."
        )
    if not isinstance(strategy, tf_workers.STRATEGIES):
        raise NotImplementedError(
            f"{head}: TensorFlow shards tables under {tf_workers.NAMES} "
            "only. Use one of them, or sharding='data'."
        )
    tf_workers.check_built_outside_step(head)
    if layer.sparse_optimizer is None:
        raise ValueError(
            f"{head} needs a sparse `optimizer` (the owners update their part "
            "in the backward pass); with optimizer=None use sharding='data'."
        )
    if layer.sharding == "column":
        _check_column(layer, head, replicas)
    # Its all-gathers need a step without XLA: "auto" (a model loaded from a
    # file saved on another backend included) then picks one.
    layer.supports_jit = False
    return TfShardedPlacement(layer.sharding, replicas, strategy, layer.name)


def _check_column(layer, head, replicas):
    if layer.output_dim % replicas:
        raise ValueError(
            f"{head}: `output_dim`={layer.output_dim} must be a multiple of "
            f"the {replicas} replicas (each holds output_dim / replicas "
            "columns). Use sharding='row'."
        )
    if layer.embeddings_constraint is not None:
        raise ValueError(
            f"{head} cannot apply an `embeddings_constraint` (it needs whole "
            "rows). Use sharding='row'."
        )
    if any(spec.row_wise for spec in layer.sparse_optimizer.slot_specs()):
        raise ValueError(
            f"{head} needs an element-wise optimizer; the row-wise slots of "
            f"{type(layer.sparse_optimizer).__name__} need whole rows. Use "
            "sharding='row'."
        )


class ReplicaPartVariable(keras.Variable):
    """A sharded table's (or slot's) variable: one part per replica.

    Its shape is one replica's part. ``numpy()`` (and so ``get_weights``)
    gives the whole unpadded array, as on one device; assigning it outside
    a replica's step raises (load a whole table through the layer's saved
    state: ``load_weights``, ``load_model``).
    """

    def numpy(self):
        return self._ks_placement.saved_value(self, self._ks_num_rows)

    def _direct_assign(self, value):
        context = self._ks_placement.replica_context()
        if context is None:
            raise ValueError(
                f"Layer '{self._ks_placement.layer_name}': '{self.name}' holds "
                f"one part per replica ({self._ks_placement.strategy} "
                "sharding) and cannot be assigned whole from outside a step. "
                "Load whole tables with model.load_weights(...) or "
                "keras.models.load_model(...) under the strategy's scope."
            )
        self._ks_placement.local(self, context).assign(value)


class TfShardedPlacement:
    """`TablePlacement` of a table sharded over a (MultiWorker)
    MirroredStrategy's replicas (``strategy`` "row" or "column", ``devices``
    replicas in sync, over all workers)."""

    def __init__(self, strategy, devices, distribute, layer_name):
        self.strategy = strategy
        self.devices = int(devices)
        self.distribute = distribute
        self.layer_name = layer_name

    def __repr__(self):
        return f"TfShardedPlacement({self.strategy!r}, devices={self.devices})"

    # ------------------------------------------------------------ variables
    def variable_rows(self, num_rows):
        """Rows of the whole (padded) table; `add_state_weight` cuts each
        replica's part from it."""
        if self.strategy == "column":
            return int(num_rows)
        return -(-int(num_rows) // self.devices) * self.devices

    def part_shape(self, shape):
        rows, dim = shape
        if self.strategy == "row":
            return (rows // self.devices, dim)
        return (rows, dim // self.devices)

    def _split(self, value):
        axis = 0 if self.strategy == "row" else 1
        return np.split(np.asarray(value), self.devices, axis=axis)

    def add_state_weight(self, layer, table, shape, initializer, name, **kwargs):
        """Creates ``layer``'s per-replica variable ``name`` of whole shape
        ``shape``; ``table``: its parts are cut from one draw of
        ``initializer`` over the whole shape (slots: drawn per part)."""
        dtype = kwargs.get("dtype") or layer.variable_dtype
        part = self.part_shape(tuple(shape))
        initializer = keras.initializers.get(initializer)
        parts = None
        if table:
            with tf.init_scope():
                parts = self._split(initializer(tuple(shape), dtype=dtype))
            initializer = _Constant(parts[0])
        with self.distribute.scope():
            with keras.name_scope(layer.name, caller=layer):
                variable = ReplicaPartVariable(
                    initializer=initializer,
                    shape=part,
                    dtype=dtype,
                    trainable=False,
                    autocast=kwargs.get("autocast", True),
                    aggregation="none",
                    synchronization="on_read",
                    name=name,
                )
        variable._ks_placement = self
        # A collection's stack has no num_rows: all its rows are saved.
        variable._ks_num_rows = getattr(layer, "num_rows", shape[0])
        layer._track_variable(variable)
        if parts is not None:
            local = tf_workers.local_parts(self.distribute, parts)
            for component, value in zip(self._components(variable), local, strict=True):
                component.assign(value)
        return variable

    def _components(self, variable):
        return self.distribute.experimental_local_results(variable.value)

    def saved_value(self, variable, num_rows):
        """The whole unpadded array of ``variable`` (NumPy; across workers
        a collective: every worker must ask, in the same order)."""
        whole = np.asarray(self._whole(variable))
        return whole[:num_rows] if self.strategy == "row" else whole

    def _whole(self, variable):
        """The whole padded table of ``variable`` (a tensor)."""
        axis = 0 if self.strategy == "row" else 1
        parts = self._components(variable)
        if tf_workers.is_multi_worker(self.distribute, parts):
            return tf_workers.gather_whole(self.distribute, variable.value, axis)
        return tf.concat(list(parts), axis)

    def saved_shape(self, variable, num_rows):
        rows, dim = variable.shape
        if self.strategy == "row":
            return (int(num_rows), int(dim))
        return (int(num_rows), int(dim) * self.devices)

    def assign_saved(self, variable, num_rows, value):
        """Assigns each replica its part of ``value`` (the whole table)."""
        value = np.asarray(value)
        if self.strategy == "row":
            rows = int(variable.shape[0]) * self.devices
            pad = [(0, rows - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
            value = np.pad(value, pad)
        parts = tf_workers.local_parts(self.distribute, self._split(value))
        for component, part in zip(self._components(variable), parts, strict=True):
            component.assign(part.astype(component.dtype.as_numpy_dtype))

    # --------------------------------------------------------------- lookups
    def replica_context(self):
        """The replica context of a step of this placement's strategy, or
        None (cross-replica context, or another strategy)."""
        if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
            return None
        if tf.distribute.get_strategy() is not self.distribute:
            return None
        return tf.distribute.get_replica_context()

    def local(self, variable, context):
        """This replica's component of ``variable`` (a tf.Variable)."""
        me = tf_sharded_lookup.replica_id(context)
        first = tf_workers.first_local_replica(self.distribute)
        return self._components(variable)[me - first]

    def _check_step(self):
        if tf_row_updates.in_xla():
            raise NotImplementedError(
                f"Layer '{self.layer_name}': sharding={self.strategy!r} cannot "
                "run in an XLA-compiled step: its all-gathers of the replicas' "
                "ids and rows need a step without XLA. Compile the model with "
                "jit_compile=False."
            )

    def lookup(self, state: TableState, batch: LookupBatch):
        """Rows of ``batch.ids``; the backward pass updates the owners'
        parts (``apply_update``, ``segments``, ``exchange_slot`` and
        ``blocks`` are not used: each replica updates its own part)."""
        context = self.replica_context()
        if context is None or batch.reset is not None:
            raise NotImplementedError(
                f"Layer '{self.layer_name}': a {self.strategy}-sharded table "
                "trains only inside its strategy's steps (model.fit, or "
                "strategy.run)."
            )
        self._check_step()
        parts = {"table": self.local(state.table_var, context)}
        parts.update({n: self.local(v, context) for n, v in state.slot_vars.items()})
        anchor = tf.convert_to_tensor(_tf_variable(state.anchor_var))
        return tf_sharded_lookup.sharded_lookup(
            self.strategy, context, parts, anchor, state.optimizer, batch.ids,
            batch.valid, batch.iterations, state.constraint,
            state.stochastic_rounding,
        )  # fmt: skip

    def gather(self, table_var, batch: LookupBatch):
        """Rows of ``batch.ids`` with no update (outside a step: from the
        whole table)."""
        ids = tf.cast(batch.ids, tf.int32)
        valid = tf.cast(batch.valid, tf.bool)
        context = self.replica_context()
        if context is None:
            return gather_valid(self._whole(table_var), ids, valid)
        self._check_step()
        state = {"table": self.local(table_var, context)}
        return tf_sharded_lookup.sharded_lookup(
            self.strategy, context, state, None, None, ids, valid, None, None
        )


class _Constant:
    """An initializer returning a fixed array (one replica's part)."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return tf.constant(self.value, dtype=dtype)
