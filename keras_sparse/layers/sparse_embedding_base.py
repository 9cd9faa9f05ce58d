"""Shared machinery of the keras_sparse embedding layers.

Owns the table, the sparse optimizer's slot variables and step counter, the
lookup (dense or with the in-backward sparse update), pooling and saving.
Subclasses turn their inputs into in-range row ids plus a validity mask.
"""

import keras
from keras import ops

from keras_sparse import optimizers as sparse_optimizers
from keras_sparse.layers import pooling
from keras_sparse.ops import backend_module
from keras_sparse.sharding import keras_integration as _sharding  # sharding hook

SHARDING_CHOICES = ("auto", "data", "table", "row", "column")


def check_sharding(layer_name, sharding):
    if sharding not in SHARDING_CHOICES:
        raise ValueError(
            f"Layer '{layer_name}': unknown `sharding`={sharding!r}. Valid "
            f"choices are {', '.join(repr(c) for c in SHARDING_CHOICES)}."
        )


class SparseEmbeddingBase(keras.layers.Layer):
    """Table + optional sparse optimizer + combiner. Not used directly."""

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
        **kwargs,
    ):
        super().__init__(**kwargs)
        pooling.check_combiner(self.name, combiner)
        check_sharding(self.name, sharding)
        self.num_rows = num_rows
        self.output_dim = output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.combiner = combiner
        self.sparse_optimizer = sparse_optimizers.get(optimizer, f"Layer '{self.name}'")
        self.sharding = sharding
        self.slots = {}

    # ----------------------------------------------------------------- state
    @property
    def uses_sparse_update(self):
        return self.sparse_optimizer is not None

    def build(self, input_shape=None):
        if self.built:
            return
        sparse = self.uses_sparse_update
        # On JAX the updated table travels back as the table's "gradient" and
        # the Keras optimizer assigns it (overwrite_with_gradient); elsewhere
        # the backward pass writes the variables itself.
        on_jax = keras.backend.backend() == "jax"
        self.embeddings = self.add_weight(
            shape=(self.num_rows, self.output_dim),
            initializer=self.embeddings_initializer,
            regularizer=None if sparse else self.embeddings_regularizer,
            constraint=None if sparse else self.embeddings_constraint,
            trainable=(not sparse) or on_jax,
            autocast=False,
            name="embeddings",
        )
        if sparse:
            self._build_sparse_state(on_jax)
        self.built = True

    def _build_sparse_state(self, on_jax):
        self.embeddings.overwrite_with_gradient = on_jax
        for spec in self.sparse_optimizer.slot_specs():
            slot = self.add_weight(
                shape=spec.shape(self.num_rows, self.output_dim),
                initializer=keras.initializers.Constant(spec.initial_value),
                trainable=on_jax,
                autocast=False,
                name=spec.name,
            )
            slot.overwrite_with_gradient = on_jax
            self.slots[spec.name] = slot
        self.sparse_iterations = self.add_weight(
            shape=(),
            initializer="zeros",
            dtype="int32",
            trainable=False,
            name="sparse_iterations",
        )
        self.sparse_anchor = None
        if not on_jax:
            self.sparse_anchor = self.add_weight(
                shape=(),
                initializer="zeros",
                trainable=True,
                name="sparse_update_anchor",
            )

    # ---------------------------------------------------------------- lookup
    def lookup_rows(self, ids, valid, training, reset=None):
        """Gathers ``[..., dim]`` rows; invalid positions read zeros.

        In training with a sparse optimizer the backward pass updates the
        touched rows (duplicates summed; invalid positions update nothing).
        ``reset=(mask, values)`` (training only) first re-initializes the rows
        at the flat positions ``mask`` to ``values`` with fresh optimizer
        slots, as the dynamic-vocabulary layer needs for newly assigned rows.
        """
        flat_ids = ops.reshape(ids, (-1,))
        flat_valid = ops.reshape(valid, (-1,))
        # --- keras_sparse.sharding hook (begin): None unless JAX + an active
        # ModelParallel distribution + a row/column strategy for this layer.
        routing = _sharding.route(self)
        # --- keras_sparse.sharding hook (end)
        sparse = self.uses_sparse_update and self.trainable
        update = sparse and bool(training)
        on_jax = keras.backend.backend() == "jax"
        if update or (sparse and on_jax):
            # On JAX the table is overwritten with whatever its "gradient" is,
            # so even inference calls go through the primitive, which then
            # hands the state back unchanged.
            iterations = ops.convert_to_tensor(self.sparse_iterations)
            if update:
                # A fresh tensor: on torch the assign below updates the
                # variable's storage in place before the backward pass runs.
                next_iterations = iterations + 1
                iterations = next_iterations - 1
                self.sparse_iterations.assign(next_iterations)
            kwargs = {"apply_update": update} if on_jax else {}
            if reset is not None:
                kwargs["reset"] = reset
            lookup = backend_module().lookup_with_sparse_update
            if routing is not None:  # sharding hook
                lookup = _sharding.routed_lookup(routing)
            rows = lookup(
                self.embeddings,
                self.slots,
                self.sparse_anchor,
                self.sparse_optimizer,
                flat_ids,
                flat_valid,
                iterations,
                self.embeddings_constraint,
                **kwargs,
            )
            if update and self.embeddings_regularizer is not None:
                self.add_loss(self.embeddings_regularizer(rows))
        elif routing is not None:  # sharding hook
            rows = _sharding.routed_gather(
                routing, self.embeddings, flat_ids, flat_valid
            )
        else:
            safe = ops.where(flat_valid, flat_ids, ops.zeros_like(flat_ids))
            rows = ops.take(self.embeddings, safe, axis=0)
            rows = ops.where(ops.expand_dims(flat_valid, -1), rows, 0)
        out_shape = tuple(ops.shape(ids)) + (self.output_dim,)
        return ops.reshape(rows, out_shape)

    def combine(self, rows, weights, valid):
        """Pools (combiner set) or scales (weights given) looked-up rows."""
        if self.combiner is None:
            if weights is not None:
                rows = rows * ops.expand_dims(ops.cast(weights, rows.dtype), -1)
            return rows
        if weights is None:
            weights = ops.ones(ops.shape(valid), rows.dtype)
        weights = ops.where(valid, ops.cast(weights, rows.dtype), 0)
        return pooling.pool(rows, weights, self.combiner)

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        if self.combiner is not None and len(shape) >= 2:
            shape = shape[:-1]
        return shape + (self.output_dim,)

    # ----------------------------------------------------------------- state
    def _named_variables(self):
        named = {"embeddings": self.embeddings}
        if self.uses_sparse_update:
            named.update({f"slot_{k}": v for k, v in self.slots.items()})
            named["sparse_iterations"] = self.sparse_iterations
        return named

    def save_own_variables(self, store):
        for name, variable in self._named_variables().items():
            store[name] = variable.numpy()

    def load_own_variables(self, store):
        for name, variable in self._named_variables().items():
            if name in store:
                variable.assign(store[name])
            elif name == "embeddings":
                raise ValueError(
                    f"Layer '{self.name}': the saved state has no 'embeddings'."
                )

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
            }
        )
        return config
