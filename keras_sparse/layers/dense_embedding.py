"""AllToAllDenseEmbedding: a drop-in for keras.layers.Embedding.

The layer class: construction, build, lookups and the cache's methods.
Its argument checks are in `keras_sparse.layers.dense_embedding_arguments`,
its weights and saves in `keras_sparse.layers.dense_embedding_saves`, its
change tracking and delta exports in
`keras_sparse.layers.dense_embedding_deltas`, LoRA and int8/int4 tables in
`keras_sparse.layers.dense_embedding_quantization`.
"""

import keras
from keras import ops

from keras_sparse.backend_utils import is_tf_ragged
from keras_sparse.layers import dense_embedding_arguments as arguments
from keras_sparse.layers import dense_embedding_deltas as deltas
from keras_sparse.layers import dense_embedding_quantization as quantization
from keras_sparse.layers import dense_embedding_saves as saves
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import pooling
from keras_sparse.layers import row_changes
from keras_sparse.layers.hash import serving_hooks
from keras_sparse.layers.row_storage import cache as cached_rows
from keras_sparse.layers.row_storage import cache_checks
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.layers.table_storage import TableStorage


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
        track_changes, store_spec = arguments.checked(
            name,
            kwargs,
            input_dim,
            output_dim,
            mask_zero=mask_zero,
            lora_rank=lora_rank,
            quantization_config=quantization_config,
            optimizer=optimizer,
            sharding=sharding,
            cache_rows=cache_rows,
            store=store,
            track_changes=track_changes,
        )
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
            quantization.refuse_with_sparse_optimizer(
                self.name, "dtype", self.dtype_policy.name
            )
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
        # `model.export` gives the table an updatable entry in the artifact
        # (`keras_sparse.layers.dense_serving_export`).
        serving_hooks.install()
        if weights is not None:
            saves.set_initial_weights(self, weights)

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

    def export(self, since_step=-1):
        """The rows changed after step ``since_step`` (-1: every row) as a
        delta: ``keys`` (row ids), ``values``, the optimizer slots by name
        and what describes it (``layer``, ``since_step``, ``step``,
        ``dtype``); `keras_sparse.apply_delta` applies deltas in order
        (see `keras_sparse.layers.dense_deltas`). Needs
        ``track_changes=True``."""
        return deltas.export(self, since_step)

    # ------------------------------------------------------ LoRA, quantization
    def enable_lora(
        self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"
    ):
        quantization.enable_lora(self, rank, lora_alpha, a_initializer, b_initializer)

    def quantize(self, mode=None, type_check=True, config=None):
        # As Keras does for its own subclasses: a subclass of this layer may
        # have state the quantized variables would not cover.
        if type_check and type(self) is not Embedding:
            raise self._not_implemented_error(self.quantize)
        quantization.quantize(self, mode, config)

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
        return quantization.quantized_call(self, inputs, weights, training)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or self.combiner is not None:
            return None
        return ops.not_equal(inputs, 0)

    def compute_output_spec(self, inputs, weights=None, training=None):
        ragged = getattr(inputs, "ragged", False) and self.combiner is None
        shape = self.compute_output_shape(inputs.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype, ragged=ragged)

    # ----------------------------------------------------------------- state
    def _named_variables(self):
        # The table under Keras's key "0", so weight files move both ways
        # between this layer and keras.layers.Embedding.
        named = {"0": self._embeddings}
        if self.uses_sparse_update:
            named.update({f"slot_{k}": v for k, v in self.slots.items()})
            named["sparse_iterations"] = self.sparse_iterations
        return named

    def get_weights(self):
        if self.row_cache is None:
            return super().get_weights()
        return saves.cached_weights(self)

    def set_weights(self, weights):
        if self.row_cache is not None and not self.built:
            self.build()
        if not self.built:
            return self._set_weights(weights)
        return deltas.written(self, lambda: self._set_weights(weights))

    def _set_weights(self, weights):
        if self.row_cache is None:
            return super().set_weights(weights)
        saves.set_cached_weights(self, weights)

    def save_own_variables(self, store):
        saves.save_own_variables(self, store)

    def load_own_variables(self, store):
        saves.load_own_variables(self, store)

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


# The public name. The class itself is named ``Embedding`` because Keras
# files place a layer's weights under its class name: a model keeps the
# same weight paths whether it uses keras.layers.Embedding or this layer.
AllToAllDenseEmbedding = Embedding
# Configs saved while the class was registered under its public name.
keras.saving.get_custom_objects()["keras_sparse>AllToAllDenseEmbedding"] = Embedding
