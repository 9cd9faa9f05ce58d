"""Shared machinery of the keras_sparse embedding layers.

Owns the table, the sparse optimizer's slot variables and step counter, the
lookup (dense or with the in-backward sparse update), pooling and saving.
Subclasses turn their inputs into in-range row ids plus a validity mask.
"""

import keras
from keras import ops

from keras_sparse import optimizers as sparse_optimizers
from keras_sparse.backend_utils import is_symbolic
from keras_sparse.layers import atomic_save
from keras_sparse.layers import placement
from keras_sparse.layers import pooling
from keras_sparse.layers import quantized_rows as quantized
from keras_sparse.layers.dedup_scratch import scratch_segments
from keras_sparse.layers.row_storage import variables as row_variables
from keras_sparse.layers.table_storage import TableStorage
from keras_sparse.ops import backend_module
from keras_sparse.ops import check_replicated_training
from keras_sparse.ops import dense_row_updates
from keras_sparse.ops.lookup_batch import LookupBatch
from keras_sparse.ops.lookup_batch import TableState

SHARDING_CHOICES = ("auto", "data", "table", "row", "column")
#: Hash layers may also own their keys per device.
HASH_SHARDING_CHOICES = SHARDING_CHOICES + ("key",)


def check_sharding(layer_name, sharding, choices=SHARDING_CHOICES):
    if sharding not in choices:
        raise ValueError(
            f"Layer '{layer_name}': unknown `sharding`={sharding!r}. Valid "
            f"choices are {', '.join(repr(c) for c in choices)}."
        )


class SparseEmbeddingBase(keras.layers.Layer):
    """Table + optional sparse optimizer + combiner. Not used directly."""

    #: "fixed" (a fixed vocabulary, ids < 2**31) or "hash" (keys mapped by
    #: a hash table); read by modules that must not import the classes.
    keras_sparse_kind = "fixed"

    def __init__(
        self,
        num_rows,
        output_dim,
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        *,
        combiner=None,
        optimizer=None,
        sharding="auto",
        table_storage=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_rows = num_rows
        self.output_dim = output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self._init_sparse(combiner, optimizer, sharding, table_storage)

    def _init_sparse(self, combiner, optimizer, sharding, table_storage=None):
        """Validates and stores the keras_sparse extras (after Layer init);
        ``table_storage``: a `TableStorage` (None: the variable dtype)."""
        pooling.check_combiner(self.name, combiner)
        key_shardable = getattr(self, "_key_shardable", False)
        check_sharding(
            self.name,
            sharding,
            HASH_SHARDING_CHOICES if key_shardable else SHARDING_CHOICES,
        )
        self.combiner = combiner
        self.sparse_optimizer = sparse_optimizers.get(optimizer, f"Layer '{self.name}'")
        self.sharding = sharding
        self.table_storage = table_storage or TableStorage(self.name)
        self.table_storage.check_sparse(self.name, self.sparse_optimizer is not None)
        self.slots = {}
        # ``{name: variable}`` of an int8/int4 table (a hash layer's
        # `quantize`), else None.
        self.quantized_rows = None
        # A `TablePlacement` when built sharded on TensorFlow or PyTorch.
        self.placement = None
        # Saves of models holding this layer replace their file atomically.
        atomic_save.install()

    # ----------------------------------------------------------------- state
    @property
    def uses_sparse_update(self):
        return self.sparse_optimizer is not None

    def build(self, input_shape=None):
        if self.built:
            return
        if self.quantization_mode in quantized.MODES:  # a quantized save
            size = quantized.block_size(self)
            self.quantized_rows = quantized.add_variables(
                self, self.num_rows, self.output_dim, self.quantization_mode, size
            )
            if self.uses_sparse_update:  # the counter (saved), no anchor
                row_variables.add_step_counter(self)
                if self.sparse_anchor is not None:
                    delattr(self, "sparse_anchor")  # untracks the variable
                    self.sparse_anchor = None
            self._is_quantized = True
            self.built = True
            return
        self.embeddings = self._build_table()
        self.built = True

    def _build_table(self):
        """The table variable (plus, with a sparse optimizer, its slots and
        step counter: `keras_sparse.layers.row_storage.variables`)."""
        hooks = placement.provider()
        # --- keras_sparse.sharding hooks: on TensorFlow and PyTorch a sharded
        # table is built holding this device's part; row-sharded tables whose
        # rows do not divide by the device count get zero padding rows.
        # Under tf.distribute a row- or column-sharded table's variables
        # hold one part per replica (`add_state_weight`).
        self.placement = hooks.build_placement(self)
        rows = hooks.variable_rows(self)
        # Columns of this device's part (column-sharded across processes).
        self._variable_dim = hooks.variable_dim(self)
        sparse = self.uses_sparse_update
        table, slots = row_variables.add_table(
            self,
            lambda is_table, **kwargs: hooks.add_state_weight(self, is_table, **kwargs),
            rows,
            self._variable_dim,
            hooks.table_initializer(self, rows),
            name="embeddings",
            regularizer=None if sparse else self.embeddings_regularizer,
            constraint=None if sparse else self.embeddings_constraint,
            slot_options=_dtype_argument(self.table_storage.slot_dtype),
            **_dtype_argument(self.table_storage.table_dtype),
        )
        for name, slot in slots.items():
            self.slots[name] = slot
        if sparse:
            row_variables.add_step_counter(self)
        return table

    # ---------------------------------------------------------------- lookup
    def lookup_rows(
        self, ids, valid, training, reset=None, segments=None, exchange_slot=None
    ):
        """Gathers ``[..., dim]`` rows; invalid positions read zeros.

        In training with a sparse optimizer the backward pass updates the
        touched rows (duplicates summed; invalid positions update nothing).
        ``reset=(mask, values)`` (training only) first re-initializes the rows
        at the flat positions ``mask`` to ``values`` with fresh optimizer
        slots, as the dynamic-vocabulary layer needs for newly assigned rows.
        ``segments``: optional segment index of each (flat) position among
        the distinct ids, computed ahead of the step by the input stage; the
        sparse update then skips its sort (unsharded lookups only).
        ``exchange_slot``: optional slot of each position in its owner's
        row-exchange buffer, computed ahead of the step by the input stage
        (row-sharded lookups with compact buffers only, see
        `keras_sparse.sharding.exchange_buckets`).
        """
        flat_ids = ops.reshape(ids, (-1,))
        flat_valid = ops.reshape(valid, (-1,))
        if self.quantized_rows is not None:  # int8/int4 rows, read only
            safe = ops.where(flat_valid, flat_ids, ops.zeros_like(flat_ids))
            rows = quantized.gather(
                self.quantized_rows,
                safe,
                self.quantization_mode,
                self.output_dim,
                "float32",
            )
            rows = ops.where(ops.expand_dims(flat_valid, -1), rows, 0)
            return ops.reshape(rows, tuple(ops.shape(ids)) + (self.output_dim,))
        # --- keras_sparse.sharding hook: None unless JAX + an active
        # ModelParallel distribution + a row/column strategy for this layer.
        routing = placement.provider().route(self)
        rows = lookup_flat_rows(
            self,
            self.embeddings,
            self.slots,
            flat_ids,
            flat_valid,
            training,
            sparse_step(self, training),
            routing,
            reset,
            segments,
            exchange_slot,
        )
        out_shape = tuple(ops.shape(ids)) + (self.output_dim,)
        return ops.reshape(rows, out_shape)

    def bag_sums(self, ids, valid, training):
        """``[batch, dim]`` sums of each bag's rows, or None.

        Where the backend fuses the gather and the sum of a bag and the
        sparse update runs (PyTorch on a CPU: ``embedding_bag``; every id
        valid, one process, no row regularizer, no sharding; TensorFlow on
        a CPU, also in a traced step with the sum combiner), this is one
        operation instead of `lookup_rows` and `combine`, and the backward
        pass never expands the bags' gradients to their positions. None
        where that route does not apply.
        """
        module = backend_module()
        if (
            not hasattr(module, "bag_sums_with_sparse_update")
            or not (self.uses_sparse_update and self.trainable and bool(training))
            or self.embeddings_regularizer is not None
            or not bag_sums_traced(module, ids, [self.combiner])
            or placement.provider().route(self) is not None
            or not module.bag_sums_apply(self.embeddings, [ids], [valid])
        ):
            return None
        return module.bag_sums_with_sparse_update(
            table_state(self, self.embeddings, self.slots),
            [ids],
            sparse_step(self, training),
            valids=[valid],
        )

    def combine(self, rows, weights, valid):
        """Pools (combiner set) or scales (weights given) looked-up rows."""
        return combine_rows(rows, weights, valid, self.combiner)

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        if self.combiner is not None and len(shape) >= 2:
            shape = shape[:-1]
        return shape + (self.output_dim,)

    def quantize(self, mode=None, **kwargs):
        raise NotImplementedError(
            f"Layer '{self.name}' ({type(self).__name__}) does not support "
            "quantization yet; quantize the dense layers only."
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "output_dim": self.output_dim,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "embeddings_regularizer": keras.regularizers.serialize(
                    self.embeddings_regularizer
                ),
                "embeddings_constraint": keras.constraints.serialize(
                    self.embeddings_constraint
                ),
                "combiner": self.combiner,
                "optimizer": None
                if self.sparse_optimizer is None
                else sparse_optimizers.serialize(self.sparse_optimizer),
                "sharding": self.sharding,
                **self.table_storage.config(),
            }
        )
        return config


def _dtype_argument(dtype):
    """``add_weight``'s ``dtype`` where a storage dtype is set (else the
    layer's variable dtype, as before)."""
    return {} if dtype is None else {"dtype": dtype}


def combine_rows(rows, weights, valid, combiner):
    """Pools (``combiner`` set) or scales (weights given) looked-up rows."""
    if combiner is None:
        if weights is not None:
            rows = rows * ops.expand_dims(ops.cast(weights, rows.dtype), -1)
        return rows
    if weights is None:
        return pooling.pool_unweighted(rows, valid, combiner)
    weights = ops.where(valid, ops.cast(weights, rows.dtype), 0)
    return pooling.pool(rows, weights, combiner)


def bag_sums_traced(module, ids, combiners):
    """Whether the backend's fused bags may serve ``ids``: eager ones (its
    ``bag_sums_apply`` may read every id on the host), or traced ones where
    it serves all ``combiners`` without a host check (its
    ``TRACED_BAG_COMBINERS``; none: PyTorch's needs every id valid)."""
    traced = getattr(module, "TRACED_BAG_COMBINERS", ())
    return not is_symbolic(ids) or all(c in traced for c in combiners)


def sparse_step(layer, training):
    """This call's sparse-optimizer step (a tensor), or None.

    None when the call needs no sparse primitive. In training the layer's
    ``sparse_iterations`` counter is incremented (once per call: a layer
    owning several tables, `EmbeddingCollection`, shares one counter).
    """
    sparse = layer.uses_sparse_update and layer.trainable
    update = sparse and bool(training)
    on_jax = keras.backend.backend() == "jax"
    # On JAX the table is overwritten with whatever its "gradient" is,
    # so even inference calls go through the primitive, which then
    # hands the state back unchanged.
    if not (update or (sparse and on_jax)):
        return None
    iterations = ops.convert_to_tensor(layer.sparse_iterations)
    if update:
        # Before the counter moves: what replicas cannot train raises here.
        check_replicated_training(layer.name)
        # A fresh tensor: on torch the assign below updates the
        # variable's storage in place before the backward pass runs.
        next_iterations = iterations + 1
        iterations = next_iterations - 1
        layer.sparse_iterations.assign(next_iterations)
    return iterations


def storage_of(layer, table):
    """The `TableStorage` of ``table``: the layer's, or a collection's for
    the stack the variable holds (`EmbeddingCollection.table_storage_of`)."""
    storage = getattr(layer, "table_storage", None)
    if storage is None and hasattr(layer, "table_storage_of"):
        storage = layer.table_storage_of(table)
    return storage or TableStorage(layer.name)


def table_state(layer, table, slots):
    """The `TableState` of ``table`` (a variable of ``layer``) and its
    optimizer ``slots``."""
    return TableState(
        table,
        slots,
        layer.sparse_anchor,
        layer.sparse_optimizer,
        layer.embeddings_constraint,
        storage_of(layer, table).stochastic_rounding,
    )


def lookup_flat_rows(
    layer,
    table,
    slots,
    flat_ids,
    flat_valid,
    training,
    iterations,
    routing,
    reset=None,
    segments=None,
    exchange_slot=None,
    blocks=None,
):
    """``[N, dim]`` rows of ``table`` (a variable of ``layer``) at ``flat_ids``.

    The lookup shared by every keras_sparse layer: with ``iterations`` (from
    ``layer.sparse_step``) the per-backend primitive whose backward applies
    ``layer.sparse_optimizer`` to the touched rows of ``table`` and ``slots``;
    otherwise a plain (dense-gradient) gather. ``routing`` (from
    `keras_sparse.sharding.routing.route`) selects the sharded
    primitive. Every argument reaches either as one `LookupBatch`; the
    unsharded primitive uses ``segments`` (see
    `SparseEmbeddingBase.lookup_rows`), the sharded one ``exchange_slot``.
    ``blocks``: ``(batch_major, extents, row_ranges)`` of the tables of a
    stacked ``table``, updated table by table on PyTorch and on TensorFlow
    without XLA (see `keras_sparse.ops.row_updates.TableBlocks`; under XLA
    the per-table writes into one variable would run one after another).
    The layer supplies ``sparse_optimizer``, ``sparse_anchor``,
    ``embeddings_constraint``, ``embeddings_regularizer`` and ``add_loss``.
    """
    on_jax = keras.backend.backend() == "jax"
    if exchange_slot is not None:
        exchange_slot = ops.reshape(exchange_slot, (-1,))
    if iterations is not None:
        update = layer.uses_sparse_update and layer.trainable and bool(training)
        if _needs_segments(layer, table, flat_ids, segments, update, routing):
            segments = scratch_segments(layer, table, flat_ids, flat_valid)
        if not update:
            segments = None  # an inference call (JAX) numbers no rows
        batch = LookupBatch(
            flat_ids,
            flat_valid,
            iterations,
            apply_update=update,
            reset=reset,
            segments=None if segments is None else ops.reshape(segments, (-1,)),
            exchange_slot=exchange_slot,
            blocks=blocks,
        )
        state = table_state(layer, table, slots)
        # A sharded table's `TablePlacement`, else the backend's primitive.
        lookup = backend_module().lookup if routing is None else routing.lookup
        rows = lookup(state, batch)
        loss = None
        if on_jax:
            loss = _zero_that_reaches(rows)
        if update and layer.embeddings_regularizer is not None:
            penalty = layer.embeddings_regularizer(rows)
            if not on_jax:
                # The penalty covers this replica's rows only, but Keras
                # divides added losses by the replica count (tf.distribute)
                # and DDP averages gradients: scale it to the global batch's.
                penalty = penalty * backend_module().replica_count()
            loss = penalty if loss is None else penalty + loss
        if loss is not None:
            layer.add_loss(loss)
        return rows
    if routing is not None:  # a sharded table's `TablePlacement`
        return routing.gather(
            table, LookupBatch(flat_ids, flat_valid, exchange_slot=exchange_slot)
        )
    safe = ops.where(flat_valid, flat_ids, ops.zeros_like(flat_ids))
    rows = ops.take(table, safe, axis=0)
    return ops.where(ops.expand_dims(flat_valid, -1), rows, 0)


def _needs_segments(layer, table, flat_ids, segments, update, routing):
    """Whether to find this call's segments by the dedup scratch: for an
    unsharded sparse update that has none yet and does not update the whole
    table (`keras_sparse.ops.dense_row_updates`, which needs no segments)."""
    if segments is not None or not update or routing is not None:
        return False
    return not dense_row_updates.uses_dense_route(
        flat_ids.shape[0], table.shape[0], layer.embeddings_constraint
    )


def _zero_that_reaches(rows):
    """An exact 0.0 loss term whose gradient reaches ``rows`` (as zeros).

    On JAX the table variable is overwritten with its "gradient", which the
    lookup's backward pass sets to the updated table. If the layer's output
    did not reach the loss, JAX would skip that backward pass and hand the
    optimizer an all-zero gradient, wiping the table. This term keeps the
    backward pass on the path (with a zero cotangent, so the update is that
    of a zero gradient); its value is exactly 0 even for non-finite rows.
    """
    never = ops.zeros((), "bool")
    return ops.sum(ops.where(never, rows, ops.zeros_like(rows)))
