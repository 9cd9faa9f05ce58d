"""AllToAllDenseEmbedding: a drop-in for keras.layers.Embedding."""

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_tf_ragged
from keras_sparse.layers import dense_deltas
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import placement
from keras_sparse.layers import pooling
from keras_sparse.layers import quantized_rows
from keras_sparse.layers import row_changes
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.row_storage import cache as cached_rows
from keras_sparse.layers.row_storage import cache_checks
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS
from keras_sparse.layers.table_storage import TableStorage


def _check_positive_int(layer_name, name, value):
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value <= 0
    ):
        raise ValueError(
            f"Layer '{layer_name}': `{name}` must be a positive integer. "
            f"Received: {name}={value!r} (of type {type(value).__name__})."
        )


def _refuse_with_sparse_optimizer(layer_name, argument, value, error=ValueError):
    raise error(
        f"Layer '{layer_name}': `{argument}`={value!r} needs optimizer=None. "
        "LoRA and quantized tables are Keras Embedding features whose "
        "variables the model's optimizer trains (or nothing trains); a "
        "sparse optimizer updates the table's rows itself. Pass "
        "optimizer=None, or drop the argument."
    )


def _quantized_policy(dtype):
    """Whether ``dtype`` (a layer's ``dtype`` argument) is int8/int4."""
    if dtype is None:
        return False
    try:
        mode = keras.dtype_policies.get(dtype).quantization_mode
    except (ValueError, TypeError):
        return False
    return mode in quantized_rows.MODES


_OWN_ARGUMENTS = (
    "input_dim",
    "output_dim",
    "embeddings_initializer",
    "embeddings_regularizer",
    "embeddings_constraint",
    "mask_zero",
    "weights",
    "lora_rank",
    "lora_alpha",
    "quantization_config",
    "combiner",
    "optimizer",
    "sharding",
    "cache_rows",
    "store",
    "track_changes",
    *STORAGE_ARGUMENTS,
    "input_length",  # deprecated by Keras, which warns and drops it
)


@keras.saving.register_keras_serializable(package="keras_sparse")
class Embedding(SparseEmbeddingBase, keras.layers.Embedding):
    """Fixed-vocabulary embedding with combiners and sparse optimizers.

    A subclass of `keras.layers.Embedding` with the same constructor, plus
    keyword-only extras. With the extras left at their defaults it is a Keras
    Embedding (LoRA, int8/int4 quantization, masking, weight files that load
    both ways, float ids cast to int32), except that in eager calls a
    non-integral float id or an id outside ``[0, input_dim)`` raises, and
    that in compiled steps an out-of-range id reads zeros (Keras: NaN on
    JAX, an error on CPU for TensorFlow and PyTorch); quantized layers look
    ids up with Keras's own int8/int4 code and its rules. The class is named
    ``Embedding`` (so Keras files place its weights where they place
    `keras.layers.Embedding`'s); ``AllToAllDenseEmbedding`` is its public name.

    Args:
        input_dim: vocabulary size; ids must be in ``[0, input_dim)``.
        output_dim: embedding width.
        embeddings_initializer: as in `keras.layers.Embedding`.
        embeddings_regularizer: as in `keras.layers.Embedding`; with a
            sparse optimizer it applies to the rows looked up in the batch.
        embeddings_constraint: as in `keras.layers.Embedding`; with a
            sparse optimizer it applies to the rows just updated.
        mask_zero: as in `keras.layers.Embedding`.
        weights: as in `keras.layers.Embedding` (initial table values).
        lora_rank: as in `keras.layers.Embedding`; needs ``optimizer=None``.
        lora_alpha: as in `keras.layers.Embedding`.
        quantization_config: as in `keras.layers.Embedding`; needs
            ``optimizer=None``.
        combiner: None returns one vector per id (like Keras); "sum", "mean"
            or "sqrtn" pool the last axis (the bag) of the ids, so
            ``[batch, bag] -> [batch, output_dim]``. Padding (``mask_zero`` ids
            0, weight 0, ragged/sparse gaps) is excluded; an empty bag pools
            to zeros.
        optimizer: None keeps Keras semantics (dense gradients through the
            model's optimizer). A name ("sgd", "adagrad", "rowwise_adagrad",
            "adam", "ftrl"), a `keras_sparse.optimizers` instance or a Keras
            SGD/Adagrad/Adam/Ftrl instance makes the layer update only the
            touched rows inside its backward pass; the model's optimizer then
            leaves the table alone.
        sharding: placement of the table across devices ("auto", "data",
            "table", "row", "column").
        cache_rows: None (the table lives in the layer's variables) or a
            positive int <= ``input_dim``: the variables then hold that many
            rows (values and slots), a cache of the ids trained lately,
            and the whole table lives in ``store``. Needs a sparse
            ``optimizer``; training is exact (see
            `keras_sparse.layers.dense_cache`). ``layer.stats()`` reports the
            cache's counters; `get_weights`, `set_weights` and saves see the
            whole table, gathered in host memory; ``layer.embeddings`` is
            the cache.
        store: where the whole table lives with ``cache_rows``: "host"
            (default), ``keras_sparse.store.Host()`` or
            ``keras_sparse.store.Disk(path)``.
        table_dtype: the table's storage dtype, "float32", "bfloat16" or
            "float16" (None: the layer's variable dtype). 16 bits need a
            sparse ``optimizer``, whose math and the lookups stay in float32
            (see `keras_sparse.layers.table_storage`).
        stochastic_rounding: whether rows written into 16-bit tables and
            slots round stochastically (default) or to nearest.
        slot_dtype: the optimizer slots' storage dtype, as ``table_dtype``
            (None: float32 under the default policy).
        track_changes: keep each row's step of last change (an int32 per
            row, written inside each training step at the batch's ids), so
            that ``export(since_step=s)`` returns the rows changed after
            step ``s`` (see `keras_sparse.layers.dense_deltas`). Needs a
            sparse ``optimizer``; not under several TensorFlow replicas or
            torch processes.

    Call arguments:
        inputs: integer ids of any rank, a JAX BCOO or (TensorFlow) a
            tf.RaggedTensor or tf.SparseTensor. Ragged ids with
            ``combiner=None`` give a ragged output, as Keras does.
        weights: optional per-id weights of the ids' shape; weight 0 marks
            padding (see `keras_sparse.ragged_to_padded`).

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> layer = ks.AllToAllDenseEmbedding(1000, 8, combiner="mean", optimizer="adagrad")
    >>> tuple(layer(np.array([[1, 2, 3], [4, 5, 6]])).shape)
    (2, 8)
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        mask_zero=False,
        weights=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        *,
        combiner=None,
        optimizer=None,
        sharding="auto",
        cache_rows=None,
        store=None,
        table_dtype=None,
        stochastic_rounding=True,
        slot_dtype=None,
        track_changes=False,
        **kwargs,
    ):
        name = kwargs.get("name") or "embedding"
        check_known(name, "AllToAllDenseEmbedding", kwargs, _OWN_ARGUMENTS)
        _check_positive_int(name, "input_dim", input_dim)
        _check_positive_int(name, "output_dim", output_dim)
        track_changes = row_changes.check_flag(name, track_changes)
        row_changes.check_sparse(name, track_changes, optimizer)
        store_spec = None
        if cache_rows is not None or store is not None:
            store_spec = cache_checks.check_arguments(
                f"Layer '{name}'", input_dim, cache_rows, store, optimizer, sharding,
                mask_zero=mask_zero, lora_rank=lora_rank,
                quantization_config=quantization_config,
            )  # fmt: skip
        if optimizer is not None:
            # A quantized layer's config (a save of `quantize()`'s result)
            # holds the config it was quantized with.
            quantized = _quantized_policy(kwargs.get("dtype"))
            for arg, value in (
                ("lora_rank", lora_rank),
                ("quantization_config", None if quantized else quantization_config),
            ):
                if value is not None:
                    _refuse_with_sparse_optimizer(name, arg, value)
        keras.layers.Embedding.__init__(
            self,
            int(input_dim),
            int(output_dim),
            embeddings_initializer,
            embeddings_regularizer,
            embeddings_constraint,
            mask_zero=bool(mask_zero),
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            quantization_config=quantization_config,
            **kwargs,
        )
        storage = TableStorage(name, table_dtype, stochastic_rounding, slot_dtype)
        storage.check_no_store(name, store_spec, "cache_rows")
        self._init_sparse(combiner, optimizer, sharding, storage)
        if self.quantization_mode and store_spec is not None:
            _refuse_with_sparse_optimizer(self.name, "dtype", self.dtype_policy.name)
        self.num_rows = self.input_dim
        self.cache_rows = None if cache_rows is None else int(cache_rows)
        self.store = store_spec
        self.row_cache = None
        self.track_changes = track_changes
        if store_spec is not None:
            cache_checks.check_initializer(
                f"Layer '{self.name}'", self.embeddings_initializer
            )
            # The cache's variables, id map and store (built with the layer).
            self.row_cache = cached_rows.cached_table(
                self.name,
                self.input_dim,
                self.output_dim,
                cache_rows,
                store_spec,
                combiner=self.combiner,
                optimizer=self.sparse_optimizer,
                initializer=self.embeddings_initializer,
                regularizer=self.embeddings_regularizer,
                constraint=self.embeddings_constraint,
                dtype=self.dtype_policy,
                name=f"{self.name}_cache",
                store_name=self.name,
                owner=self,
                track_changes=track_changes,
            )
            # Host callbacks: no XLA in TensorFlow graphs, eager torch steps.
            self.supports_jit = keras.backend.backend() == "jax"
        # JAX without x64 wraps int64 ids in fit/evaluate/predict batches;
        # the trainer hook refuses those beyond int32 before the step.
        jax_full_keys.install()
        if weights is not None:
            self._set_initial_weights(weights)

    def _set_initial_weights(self, weights):
        self.build()
        if isinstance(weights, (list, tuple)) and len(weights) == 1:
            weights = weights[0]
        weights = np.asarray(weights)
        if weights.shape != (self.input_dim, self.output_dim):
            raise ValueError(
                f"Layer '{self.name}': `weights` must have shape "
                f"{(self.input_dim, self.output_dim)}; received {weights.shape}."
            )
        if self.row_cache is not None:  # the store's values; slots unchanged
            table = self.row_cache.full_table()
            table["values"] = weights
            self.row_cache.write_table(table)
            return
        if self.quantization_mode:
            raise ValueError(
                f"Layer '{self.name}': `weights` cannot initialize a quantized "
                "table; build the float layer, set its weights, then quantize."
            )
        # Padded to the variable's rows when a distribution pads the table
        # (or cut to this device's part).
        hooks = placement.provider()
        hooks.assign_value(
            self, self._embeddings, hooks.padded_value(self, self._embeddings, weights)
        )

    # ----------------------------------------------------------------- build
    def build(self, input_shape=None):
        if self.built:
            return
        if self.track_changes:
            row_changes.check_placement(self.name)
        if self.row_cache is not None:
            cached_rows.build(self.row_cache, input_shape)
            self.built = True
            return
        if self.quantization_mode:  # Keras's int8/int4 variables
            keras.layers.Embedding.build(self, input_shape)
            return
        self._embeddings = self._build_table()
        if self.track_changes:
            row_changes.add(self, self.input_dim)
        self.built = True
        if self.lora_rank:
            # As keras.layers.Embedding.build: the rank alone (so lora_alpha
            # becomes the rank, exactly as there).
            self.enable_lora(self.lora_rank)

    @property
    def embeddings(self):
        """The table variable (with ``cache_rows``: the cache's rows)."""
        if getattr(self, "row_cache", None) is not None:
            return self.row_cache.embeddings
        return keras.layers.Embedding.embeddings.fget(self)

    def stats(self):
        """With ``cache_rows``: the cache's counters (``hits``/``misses``
        of ids, ``evictions``, ``size``, ``capacity``) and its store's:
        ``fills`` (rows read into the cache), ``write_backs``,
        ``store_hits`` (ids read from the store in inference),
        ``store_size``, ``store_bytes``."""
        if self.row_cache is None:
            raise ValueError(
                f"Layer '{self.name}': stats() reports the counters of a "
                "cached table; this layer has none (cache_rows=None)."
            )
        if not self.built:
            self.build()
        return self.row_cache.stats()

    def flush_store(self):
        """With ``cache_rows``: writes the cached rows down to the store,
        empties the cache and flushes the store: it then holds the whole
        trained table, and ``ks.store.Disk(path, reopen=True)`` reopens it
        as it is (see the larger-than-memory guide)."""
        if self.row_cache is None:
            raise ValueError(
                f"Layer '{self.name}': flush_store() needs `cache_rows` and a "
                "`store`; this layer has none."
            )
        if not self.built:
            self.build()
        self.row_cache.flush_store()

    # ---------------------------------------------------------------- deltas
    def _changes(self):
        """The table's `row_changes.ChangeSteps` (None without tracking)."""
        holder = self if self.row_cache is None else self.row_cache
        return row_changes.of(holder)

    def _step(self):
        holder = self if self.row_cache is None else self.row_cache
        counter = holder.sparse_iterations
        return int(ops.convert_to_numpy(counter))

    def _table_arrays(self):
        """``{"values"|slot name: [input_dim, ...]}`` of the whole table."""
        if self.row_cache is not None:
            return self.row_cache.full_table()
        hooks = placement.provider()
        named = self._named_variables()
        out = {"values": np.asarray(hooks.unpadded_value(self, named["0"]))}
        for name, slot in self.slots.items():
            out[name] = np.asarray(hooks.unpadded_value(self, slot))
        return out

    def export(self, since_step=-1):
        """The rows changed after step ``since_step`` (-1: every row) as a
        delta: ``keys`` (row ids), ``values``, the optimizer slots by name
        and what describes it (``layer``, ``since_step``, ``step``,
        ``dtype``); `keras_sparse.apply_delta` applies deltas in order
        (see `keras_sparse.layers.dense_deltas`). Needs
        ``track_changes=True``."""
        if not self.track_changes:
            raise dense_deltas.not_tracked(self.name)
        if not self.built:
            self.build()
        dense_deltas.check_trainable(self.name, self.quantization_mode)
        step = self._step()
        since = dense_deltas.checked_since(self.name, since_step, step)
        steps = row_changes.host_steps(self._changes())
        return dense_deltas.delta(self.name, since, step, steps, self._table_arrays())

    def _written(self, write, saved_steps=None):
        """Runs ``write()`` (a set or load of the whole table); with
        tracking, marks the rows it changed (`row_changes.after_write`)."""
        if self._changes() is None or self.quantization_mode:  # none, or frozen
            return write()
        before, step = self._table_arrays(), self._step()
        out = write()
        after = self._table_arrays()
        changed = row_changes.changed_rows(list(before.values()), list(after.values()))
        row_changes.after_write(self._changes(), changed, step, saved_steps)
        return out

    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        if self.uses_sparse_update:
            _refuse_with_sparse_optimizer(self.name, "lora_rank", rank)
        keras.layers.Embedding.enable_lora(
            self, rank, lora_alpha, a_initializer, b_initializer
        )

    def quantize(self, mode=None, type_check=True, config=None):
        # As Keras does for its own subclasses: a subclass of this layer may
        # have state the quantized variables would not cover.
        if type_check and type(self) is not Embedding:
            raise self._not_implemented_error(self.quantize)
        quantized_rows.check_mode(self.name, mode)
        sharded = self.placement is not None or placement.provider().route(self)
        if self.row_cache is not None or sharded:
            # NotImplementedError: Model.quantize skips such layers.
            raise NotImplementedError(
                f"Layer '{self.name}': `quantize` needs a table held whole in "
                "the layer's variables; this one is cached over a store "
                "(`cache_rows`) or sharded. Quantize a copy built without "
                "them (set_weights moves the table)."
            )
        training_state = [self._embeddings, *self.slots.values()]
        keras.layers.Embedding.quantize(self, mode, type_check=False, config=config)
        if self.uses_sparse_update:
            # The frozen table needs no optimizer state (as Keras drops the
            # float table): slots, scratch, step counter and anchor go.
            quantized_rows.untrack(self, training_state[1:])
            scratches = getattr(self, "_dedup_scratch_by_table", {})
            name = scratches.pop(training_state[0].path, None)
            if name is not None:
                self._tracker.untrack(getattr(self, f"_dedup_scratch_{name}"))
            self.slots = {}
            for name in ("sparse_iterations", "sparse_anchor"):
                if getattr(self, name, None) is not None:
                    delattr(self, name)  # untracks the variable
            self.sparse_anchor = None

    # ------------------------------------------------------------------ call
    def __call__(self, inputs, *args, **kwargs):
        input_forms.check_host_ids(self.name, inputs, self.input_dim)
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, weights=None, training=None):
        if self.row_cache is not None:
            inputs = input_forms.cast_float_ids(self.name, inputs)
            if weights is None:
                return self.row_cache(inputs, training=training)
            return self.row_cache(inputs, weights, training=training)
        if is_tf_ragged(inputs) and self.combiner is None:
            # Ragged in, ragged out (as Keras): look up the flat values.
            flat_weights = None
            if weights is not None:
                flat_weights = getattr(weights, "flat_values", weights)
            out = self._embed(inputs.flat_values, flat_weights, training)
            return inputs.with_flat_values(out)
        return self._embed(inputs, weights, training)

    def _ids(self, inputs, weights):
        """``(ids, weights, valid)`` of any accepted input form."""
        return input_forms.fixed_vocabulary_ids(
            self.name,
            inputs,
            weights,
            self.input_dim,
            self.combiner,
            self.mask_zero,
            cast=True,
        )

    def _embed(self, inputs, weights, training):
        ids, weights, valid = self._ids(inputs, weights)
        changes = row_changes.of(self)
        if changes is not None and training and self.trainable:
            # The step's number once taken (the counter moves in the lookup).
            step = ops.convert_to_tensor(self.sparse_iterations) + 1
            row_changes.mark(changes, ids, valid, step)
        if self.combiner is not None and weights is None:
            sums = self.bag_sums(ids, valid, training)
            if sums is not None:
                out = pooling.scale_sum(sums, ops.shape(ids)[-1], self.combiner)
                return ops.cast(out, self.compute_dtype)
        rows = self.lookup_rows(ids, valid, training)
        out = self.combine(rows, weights, valid)
        return ops.cast(out, self.compute_dtype)

    def quantized_call(self, inputs, weights=None, training=None):
        """Keras's int8/int4 lookups, with combiners and per-id weights."""
        if training and self.trainable and self.uses_sparse_update:
            raise quantized_rows.training_error(self.name, "a sparse update")
        keras_call = keras.layers.Embedding.quantized_call
        if (
            self.combiner is None
            and weights is None
            and not input_forms.is_ragged_or_sparse(inputs)
        ):
            return keras_call(self, inputs, training=training)
        ids, weights, valid = self._ids(inputs, weights)
        safe = ops.where(valid, ids, ops.zeros_like(ids))
        rows = keras_call(self, safe, training=training)
        rows = ops.where(ops.expand_dims(valid, -1), rows, ops.zeros_like(rows))
        return ops.cast(self.combine(rows, weights, valid), self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or self.combiner is not None:
            return None
        return ops.not_equal(inputs, 0)

    def compute_output_spec(self, inputs, weights=None, training=None):
        ragged = getattr(inputs, "ragged", False) and self.combiner is None
        shape = self.compute_output_shape(inputs.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype, ragged=ragged)

    # ----------------------------------------------------------------- state
    def _keras_state(self):
        """True where Keras's own save/load applies (quantized or LoRA)."""
        return bool(self.quantization_mode) or self.lora_enabled

    def _named_variables(self):
        # The table under Keras's key "0", so weight files move both ways
        # between this layer and keras.layers.Embedding.
        named = {"0": self._embeddings}
        if self.uses_sparse_update:
            named.update({f"slot_{k}": v for k, v in self.slots.items()})
            named["sparse_iterations"] = self.sparse_iterations
        return named

    def _cache_entries(self):
        """``{file entry: full-table field}`` of a layer with ``cache_rows``
        (the entries of the same layer without a cache)."""
        entries = {"0": "values"}
        entries.update({f"slot_{k}": k for k in self.row_cache.slots})
        return entries

    def get_weights(self):
        if self.row_cache is None:
            return super().get_weights()
        if not self.built:
            self.build()
        table = self.row_cache.full_table()
        iterations = ops.convert_to_numpy(self.row_cache.sparse_iterations)
        return [table[f] for f in self._cache_entries().values()] + [iterations]

    def set_weights(self, weights):
        if self.row_cache is not None and not self.built:
            self.build()
        if not self.built:
            return self._set_weights(weights)
        return self._written(lambda: self._set_weights(weights))

    def _set_weights(self, weights):
        if self.row_cache is None:
            return super().set_weights(weights)
        fields = list(self._cache_entries().values())
        shapes = [(self.input_dim, int(v.shape[1])) for v in self._cache_vars()]
        weights = list(weights)
        got = [tuple(np.shape(w)) for w in weights]
        if got != shapes + [()]:
            raise ValueError(
                f"Layer '{self.name}': set_weights() takes the whole table as "
                f"get_weights() gives it ({fields} then the step count): "
                f"shapes {shapes + [()]}; received {got}. Nothing was set."
            )
        self.row_cache.write_table(dict(zip(fields, weights)), weights[-1])

    def _cache_vars(self):
        return [self.row_cache.embeddings, *self.row_cache.slots.values()]

    def save_own_variables(self, store):
        if not self.built:
            return
        if self._changes() is not None and not self._keras_state():
            store[row_changes.SAVED] = row_changes.host_steps(self._changes())
        if self.row_cache is not None:
            from keras_sparse.layers import store_assets

            if store_assets.expected():  # the table goes in the row cache's assets
                store[_TABLE_IN_ASSETS] = np.int64(self.input_dim)
                store["sparse_iterations"] = ops.convert_to_numpy(
                    self.row_cache.sparse_iterations
                )
                return
            # The whole table under the entries of a layer without a cache.
            table = self.row_cache.full_table()
            for entry, field in self._cache_entries().items():
                store[entry] = table[field]
            store["sparse_iterations"] = ops.convert_to_numpy(
                self.row_cache.sparse_iterations
            )
            return
        if self._keras_state():
            keras.layers.Embedding.save_own_variables(self, store)
            return
        # Unpadded arrays (sharding hook), so checkpoints load on any mesh.
        for name, variable in self._named_variables().items():
            store[name] = placement.provider().unpadded_value(self, variable)

    def load_own_variables(self, store):
        if self._keras_state():
            keras.layers.Embedding.load_own_variables(self, store)
            return
        saved = None
        if self.track_changes and row_changes.SAVED in set(store.keys()):
            saved = np.asarray(store[row_changes.SAVED], np.int64)
            if saved.shape != (self.input_dim,):
                raise ValueError(
                    f"Layer '{self.name}': the saved `{row_changes.SAVED}` must "
                    f"hold one step per row, shape ({self.input_dim},); "
                    f"received {saved.shape}. Nothing was loaded."
                )
        self._written(lambda: self._load_variables(store), saved)

    def _load_variables(self, store):
        if self.row_cache is not None:
            self._load_cached(store)
            return
        named = self._named_variables()
        if not len(store.keys()):
            store = _store_of_version_0_1(store)
        keys = set(store.keys())
        if "0" not in keys and "embeddings" in keys:  # files of keras_sparse 0.1
            named["embeddings"] = named.pop("0")
        missing = [name for name in named if name not in keys]
        if missing:
            raise ValueError(
                f"Layer '{self.name}': the saved state has no {missing} "
                f"(it holds {sorted(keys)}); nothing was loaded. A table saved "
                "without a sparse optimizer cannot restore one's slots: "
                "build the layer as it was saved, load, then change it."
            )
        values = {}
        hooks = placement.provider()
        for name, variable in named.items():
            value = np.asarray(hooks.padded_value(self, variable, store[name]))
            expected = tuple(hooks.loaded_shape(self, variable))
            if value.shape != expected:
                raise ValueError(
                    f"Layer '{self.name}': saved '{name}' has shape "
                    f"{value.shape}, the layer's variable {expected}"
                    "; nothing was loaded."
                )
            if name == "sparse_iterations":
                value = checked_step_count(self.name, value, variable)
            values[name] = value
        for name, variable in named.items():
            hooks.assign_value(self, variable, values[name])

    def _load_cached(self, store):
        entries = self._cache_entries()
        keys = set(store.keys())
        if _TABLE_IN_ASSETS in keys:
            from keras_sparse.layers import store_assets

            if not store_assets.expected():
                raise store_assets.missing_assets_error(self.name, self.input_dim)
            value = checked_step_count(
                self.name,
                np.asarray(store["sparse_iterations"]),
                self.row_cache.sparse_iterations,
            )
            self.row_cache.sparse_iterations.assign(value)
            # The row cache's `load_assets` (called next) brings the table.
            self.row_cache.table_in_assets = self.input_dim
            return
        missing = [e for e in [*entries, "sparse_iterations"] if e not in keys]
        if missing:
            raise ValueError(
                f"Layer '{self.name}': the saved state has no {missing} "
                f"(it holds {sorted(keys)}); nothing was loaded."
            )
        arrays = {}
        for (entry, field), var in zip(entries.items(), self._cache_vars()):
            value = store[entry]
            want = (self.input_dim, int(var.shape[1]))
            if tuple(value.shape) != want:
                raise ValueError(
                    f"Layer '{self.name}': saved '{entry}' has shape "
                    f"{tuple(value.shape)}, the layer's table {want}; nothing "
                    "was loaded."
                )
            arrays[field] = value
        self.row_cache.write_table(arrays, store["sparse_iterations"])

    def get_config(self):
        config = super().get_config()
        config.update({"input_dim": self.input_dim, "mask_zero": self.mask_zero})
        if self.row_cache is not None:
            from keras_sparse.store import serialize

            config.update(
                {"cache_rows": self.cache_rows, "store": serialize(self.store)}
            )
        if self.track_changes:
            config["track_changes"] = True
        return config


#: Weights entry of a model save whose table is in the row cache's assets.
_TABLE_IN_ASSETS = "table_in_assets"


def _store_of_version_0_1(store):
    """The layer's entry in a Keras file of keras_sparse 0.1, else ``store``.

    That version's class was named ``AllToAllDenseEmbedding``, so Keras files
    placed its weights at ``.../all_to_all_dense_embedding[_N]`` where they
    now place them at ``.../embedding[_N]`` (the N-th drop-in of a container
    in both; a model mixing it with keras.layers.Embedding numbers them
    together now). Keras's H5 store can be pointed at another path.
    """
    path = getattr(store, "_h5_entry_path", None)
    if not path or not callable(getattr(store, "get", None)):
        return store
    head, _, last = path.rpartition("/")
    if not last.startswith("embedding"):
        return store
    legacy = f"{head}/all_to_all_dense_{last}" if head else f"all_to_all_dense_{last}"
    try:
        return store.get(legacy)
    except (ValueError, KeyError, OSError):
        return store


# The public name. The class itself is named ``Embedding`` because Keras
# files place a layer's weights under its class name: a model keeps the
# same weight paths whether it uses keras.layers.Embedding or this layer.
AllToAllDenseEmbedding = Embedding
# Configs saved while the class was registered under its public name.
keras.saving.get_custom_objects()["keras_sparse>AllToAllDenseEmbedding"] = Embedding
