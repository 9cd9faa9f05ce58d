"""EmbeddingCollection: one layer owning several embedding tables.

The tables are grouped by ``(output_dim, strategy)`` into stacked variables
(one per group, plus one per optimizer slot) and each call runs one sparse
lookup per group: the group's ids, offset to their table's rows in the
stack and concatenated, then the rows split back per table. One primitive
per stacked variable keeps the in-backward sparse update exact (on JAX the
updated stack is the variable's "gradient"), and it is what lets the
"table" strategy place whole tables on devices: the stack of a table-wise
group is ``[devices * B, dim]``, row-sharded, device ``k``'s block holding
its tables (see `keras_sparse.sharding.stacks`).

Around the layer: `keras_sparse.layers.table_config` (`TableConfig`, the
tables' checks, the caches of tables with ``cache_rows``),
`keras_sparse.layers.stack_initializer` (a stack's initial values),
`keras_sparse.layers.collection_lookup` (a stack's lookup) and
`keras_sparse.layers.collection_state` (per-table save, load and assign).
"""

import keras
from keras import ops

from keras_sparse import optimizers as sparse_optimizers
from keras_sparse.layers import atomic_save
from keras_sparse.layers import collection_deltas
from keras_sparse.layers import collection_lookup
from keras_sparse.layers import collection_quantization
from keras_sparse.layers import collection_state
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import placement
from keras_sparse.layers import pooling
from keras_sparse.layers import quantized_rows
from keras_sparse.layers import row_changes
from keras_sparse.layers.arguments import ArgumentError
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.hash import serving_hooks
from keras_sparse.layers.row_storage import cache as cached_rows
from keras_sparse.layers.row_storage import variables as row_variables
from keras_sparse.layers.sparse_embedding_base import _dtype_argument
from keras_sparse.layers.sparse_embedding_base import check_sharding
from keras_sparse.layers.sparse_embedding_base import combine_rows
from keras_sparse.layers.sparse_embedding_base import sparse_step
from keras_sparse.layers.stack_initializer import StackInitializer
from keras_sparse.layers.stack_initializer import assigns_stacks_in_place
from keras_sparse.layers.table_config import table_caches
from keras_sparse.layers.table_config import table_config_of


@keras.saving.register_keras_serializable(package="keras_sparse")
class EmbeddingCollection(keras.layers.Layer):
    """Several embedding tables in one layer, with one sparse optimizer.

    Called with a dict of ids per table, it returns a dict of outputs per
    table, each exactly what an `AllToAllDenseEmbedding` with that table's
    configuration (and the same optimizer) returns and learns. Tables of equal
    ``output_dim`` share one stacked variable and one lookup per call, which
    is what makes table-wise sharding possible: under
    ``keras_sparse.distribution`` on the JAX backend, tables with
    ``sharding="table"`` each live whole on one device (the planner balances
    bytes and lookups), and "row", "column" and "data" tables are split or
    replicated as for a standalone layer. Under a TensorFlow MirroredStrategy
    or several torch.distributed processes the tables' own ``sharding``
    decides the same at build (`keras_sparse.sharding.process_stacks`).
    Without a distribution, JAX and TensorFlow steps on a CPU keep one stack
    per table instead (the per-table updates run side by side; the results
    are the same).

    Args:
        tables: ``{name: TableConfig(...) or dict of its arguments}``. Names
            are non-empty strings without "/" or ":"; they key the call's
            inputs and outputs, the saved state and the plan
            (``"collection_name/table_name"``).
        optimizer: sparse optimizer for every table, resolved like
            `AllToAllDenseEmbedding`'s (None: dense gradients through the
            model's optimizer; then only the "data" strategy can be used).
        sharding: default strategy of the tables whose own ``sharding`` is
            "auto".
        track_changes: keep each row's step of last change in every table
            (an int32 per row, written inside each training step), so that
            ``export(since_step=s)`` returns each table's rows changed after
            step ``s`` (see `keras_sparse.layers.collection_deltas`). Needs
            the sparse ``optimizer``.

    Call arguments:
        inputs: ``{name: ids}`` with exactly the collection's table names;
            ids of any form `AllToAllDenseEmbedding` accepts for the table's
            combiner. Within one stack the ids of all tables must share their
            first (batch) dimension, or all shapes must be known.
        weights: optional ``{name: per-id weights}`` (any subset of tables).

    Returns:
        ``{name: output}`` in the order of ``tables``.

    The saved state is per table (``"{name}:embeddings"``,
    ``"{name}:slot_{slot}"``, unpadded and unstacked) plus
    ``sparse_iterations``, so a ``.keras`` file loads under any device count,
    grouping or strategy (`keras_sparse.sharding.load_model`).

    A table with ``cache_rows`` (see `TableConfig`) is in no stack: it is a
    cache of that many rows over a row store (``table_caches[name]``, built
    by `keras_sparse.layers.row_storage.cache` as for
    `AllToAllDenseEmbedding`), trained exactly as the same table without
    a cache; ``stats(name)`` gives its counters, and `get_table`,
    `set_table` and saves see its whole table: ``model.save`` streams it
    through the file's asset files (the cache's ``save_assets``; the
    weights hold ``"{name}:table_in_assets"``), other saves gather it in
    host memory under the entries of a table without a cache.

    Example:

    >>> import numpy as np, keras_sparse as ks
    >>> features = ks.EmbeddingCollection(
    ...     {
    ...         "user": ks.TableConfig(1000, 8, combiner="mean"),
    ...         "item": ks.TableConfig(500, 8),
    ...         "country": {"input_dim": 200, "output_dim": 4, "combiner": "sum"},
    ...     },
    ...     optimizer="adagrad",
    ... )
    >>> out = features(
    ...     {
    ...         "user": np.array([[1, 2], [3, 4]]),
    ...         "item": np.array([7, 9]),
    ...         "country": np.array([[5], [6]]),
    ...     }
    ... )
    >>> {k: tuple(v.shape) for k, v in out.items()}
    {'user': (2, 8), 'item': (2, 8), 'country': (2, 4)}
    """

    #: A fixed vocabulary per table (see `SparseEmbeddingBase`).
    keras_sparse_kind = "fixed"

    def __init__(
        self, tables, optimizer=None, sharding="auto", track_changes=False, **kwargs
    ):
        check_known(
            kwargs.get("name") or "embedding_collection",
            type(self).__name__,
            kwargs,
            ("tables", "optimizer", "sharding", "track_changes"),
        )
        super().__init__(**kwargs)
        self.track_changes = row_changes.check_flag(self.name, track_changes)
        row_changes.check_sparse(self.name, self.track_changes, optimizer)
        if not isinstance(tables, dict) or not tables:
            raise ValueError(
                f"Layer '{self.name}': `tables` must be a non-empty dict of "
                f"table name -> TableConfig; received {tables!r}."
            )
        configs = {}
        for name, spec in tables.items():
            if not isinstance(name, str) or not name or "/" in name or ":" in name:
                raise ValueError(
                    f"Layer '{self.name}': table names must be non-empty "
                    f"strings without '/' or ':'; received {name!r}."
                )
            configs[name] = table_config_of(self.name, name, spec)
        self.tables = configs
        check_sharding(self.name, sharding)
        self.sharding = sharding
        self.sparse_optimizer = sparse_optimizers.get(optimizer, f"Layer '{self.name}'")
        for name, config in configs.items():
            where = f"{self.name}' table '{name}"
            config.storage.check_sparse(where, self.sparse_optimizer is not None)
            strategy = sharding if config.sharding == "auto" else config.sharding
            if config.storage.is_sixteen_bit() and strategy in ("table", "column"):
                # Rows round by their row and column numbers in the table
                # (`keras_sparse.ops.row_rounding`): a table-wise stack or
                # a column shard numbers them otherwise.
                raise ArgumentError(
                    f"Layer '{where}': 16-bit storage (`table_dtype`/"
                    f"`slot_dtype`) cannot be sharded {strategy!r}-wise; use "
                    "sharding 'data', 'row' or 'auto'. Received: "
                    f"table_dtype={config.storage.table_dtype!r}, slot_dtype="
                    f"{config.storage.slot_dtype!r}, sharding={strategy!r}."
                )
        # Read by the shared lookup; per-table ones are not offered.
        self.embeddings_regularizer = None
        self.embeddings_constraint = None
        self.sparse_anchor = None
        self.stacks = []
        self._stack_tables = {}
        self._stack_slots = {}
        # ``{stack: {name: variable}}`` once quantized (int8/int4).
        self._stack_quantized = {}
        # Tables with ``cache_rows``: a cache over a row store each (not in
        # a stack), built by `keras_sparse.layers.row_storage.cache`.
        self.table_caches = table_caches(self)
        if self.table_caches and keras.backend.backend() != "jax":
            # Host callbacks: no XLA in TensorFlow graphs, eager torch steps.
            self.supports_jit = False
        # JAX without x64: int64 ids beyond int32 are refused before a step.
        jax_full_keys.install()
        # Saves of models holding this layer replace their file atomically.
        atomic_save.install()
        # `model.export` gives each table an updatable entry in the artifact
        # (`keras_sparse.layers.collection_serving_export`).
        serving_hooks.install()

    # ------------------------------------------------------------- helpers
    @property
    def uses_sparse_update(self):
        return self.sparse_optimizer is not None

    def _stacked_tables(self):
        """The configs of the tables held in stacks (no ``cache_rows``)."""
        return {n: c for n, c in self.tables.items() if n not in self.table_caches}

    def table_sharding(self, name):
        """Table ``name``'s own strategy, else the collection's."""
        own = self.tables[name].sharding
        return self.sharding if own == "auto" else own

    def stack_variables(self, stack_name):
        """The table variable of a stack followed by its slot variables."""
        return [self._stack_tables[stack_name]] + list(
            self._stack_slots[stack_name].values()
        )

    def table_storage_of(self, variable):
        """The `TableStorage` of the stack whose table is ``variable``."""
        for stack in self.stacks:
            if self._stack_tables.get(stack.name) is variable:
                return self.tables[stack.tables[0]].storage
        return None

    def _stack_of(self, name):
        for stack in self.stacks:
            if name in stack.offsets:
                return stack
        raise KeyError(name)

    # --------------------------------------------------------------- state
    def build(self, input_shape=None):
        if self.built:
            return
        # First: a cached table refuses a distribution before any variable.
        for cache in self.table_caches.values():
            cached_rows.build(cache)
        hooks = placement.provider()
        where, devices = hooks.collection_placement(self)
        self.stacks = hooks.collection_stacks(self._stacked_tables(), where, devices)
        # TensorFlow replicas / PyTorch processes: each holds its part of a
        # sharded stack (`keras_sparse.sharding.process_stacks`).
        hooks.place_stacks(self, self.stacks)
        if self.quantization_mode in quantized_rows.MODES:  # a quantized save
            collection_quantization.build(self)
            self.built = True
            return
        for stack in self.stacks:
            parts = [
                (
                    stack.offsets[n],
                    self.tables[n].input_dim,
                    self.tables[n].embeddings_initializer,
                )
                for n in stack.tables
            ]
            initializer = StackInitializer(parts, stack.dim)
            assign = assigns_stacks_in_place()

            def add(is_table, stack=stack, init=initializer, assign=assign, **kwargs):
                variable = hooks.add_stack_weight(self, stack, is_table, **kwargs)
                if is_table and assign:
                    init.assign_to(variable)
                return variable

            storage = self.tables[stack.tables[0]].storage
            table, slots = row_variables.add_table(
                self,
                add,
                stack.rows,
                stack.dim,
                "zeros" if assign else initializer,
                name=stack.name,
                slot_prefix=f"{stack.name}_",
                scratch_name=f"{stack.name}_scratch",
                slot_options=_dtype_argument(storage.slot_dtype),
                **_dtype_argument(storage.table_dtype),
            )
            self._stack_tables[stack.name] = table
            self._stack_slots[stack.name] = slots
        if self.uses_sparse_update:
            # One counter (and off JAX one anchor) for every stack: each
            # lookup's backward still runs.
            row_variables.add_step_counter(self)
        if self.track_changes:
            collection_deltas.build(self)
        self.built = True

    # ---------------------------------------------------------------- call
    def _check_names(self, what, given, required):
        if not isinstance(given, dict):
            raise TypeError(
                f"Layer '{self.name}': `{what}` must be a dict of table name "
                f"-> array; received {type(given).__name__}."
            )
        unknown = [k for k in given if k not in self.tables]
        if unknown:
            raise ValueError(
                f"Layer '{self.name}': `{what}` names unknown table(s) "
                f"{unknown}; the tables are {list(self.tables)}."
            )
        missing = [k for k in self.tables if k not in given] if required else []
        if missing:
            raise ValueError(
                f"Layer '{self.name}': `{what}` has no ids for table(s) "
                f"{missing}; pass ids for every table ({list(self.tables)})."
            )

    def __call__(self, inputs, *args, **kwargs):
        # Before Keras converts NumPy ids: JAX without x64 would wrap
        # ``2**32 + 5`` to 5 and read (and train) row 5.
        if isinstance(inputs, dict):
            for name, ids in inputs.items():
                if name in self.tables:
                    input_forms.check_host_ids(
                        f"{self.name}' table '{name}", ids, self.tables[name].input_dim
                    )
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, weights=None, training=None):
        self._check_names("inputs", inputs, required=True)
        weights = {} if weights is None else weights
        self._check_names("weights", weights, required=False)
        prepared, outputs = {}, {}
        for name, cache in self.table_caches.items():
            # The cache maps ids to its rows, looks them up and trains them
            # (as `AllToAllDenseEmbedding` with ``cache_rows`` does).
            ids = input_forms.cast_float_ids(
                f"{self.name}' table '{name}", inputs[name]
            )
            out = cache(
                ids, *([weights[name]] if name in weights else []), training=training
            )
            outputs[name] = ops.cast(out, self.compute_dtype)
        for name, config in self._stacked_tables().items():
            # Errors read "Layer 'features' table 'user': ...".
            label = f"{self.name}' table '{name}"
            prepared[name] = input_forms.fixed_vocabulary_ids(
                label,
                inputs[name],
                weights.get(name),
                config.input_dim,
                config.combiner,
            )
        if self.track_changes and training and self.trainable:
            # Before the counter moves (`sparse_step`): the step's number is
            # the counter plus one.
            counter = ops.convert_to_tensor(self.sparse_iterations)
            for stack in self.stacks:
                collection_deltas.mark(self, stack, prepared, counter)
        iterations = None if self._stack_quantized else sparse_step(self, training)
        for stack in self.stacks:
            sums = collection_lookup.bag_sums(
                self, stack, prepared, training, iterations
            )
            if sums is not None:
                for name, total in sums.items():
                    bag = ops.shape(prepared[name][0])[-1]
                    out = pooling.scale_sum(total, bag, self.tables[name].combiner)
                    outputs[name] = ops.cast(out, self.compute_dtype)
                continue
            rows = collection_lookup.lookup_stack(
                self, stack, prepared, training, iterations
            )
            for name in stack.tables:
                _, table_weights, valid = prepared[name]
                out = combine_rows(
                    rows[name], table_weights, valid, self.tables[name].combiner
                )
                outputs[name] = ops.cast(out, self.compute_dtype)
        return {name: outputs[name] for name in self.tables}

    def compute_output_shape(self, input_shape):
        out = {}
        for name, config in self.tables.items():
            shape = tuple(input_shape[name])
            if config.combiner is not None and len(shape) >= 2:
                shape = shape[:-1]
            out[name] = shape + (config.output_dim,)
        return out

    # ------------------------------------------------- per-table state
    def _named_stack_variables(self, stack):
        named = {"embeddings": self._stack_tables[stack.name]}
        named.update({f"slot_{k}": v for k, v in self._stack_slots[stack.name].items()})
        return named

    def _whole(self, stack, variable):
        """The whole stack of one of its variables (NumPy), also where each
        device holds a part of it."""
        return placement.provider().stack_value(stack, variable)

    def get_table(self, name):
        """Table ``name``'s rows as a NumPy ``[input_dim, output_dim]`` array."""
        if name not in self.tables:
            raise KeyError(
                f"Layer '{self.name}': no table {name!r}; the tables are "
                f"{list(self.tables)}."
            )
        if name in self.table_caches:  # the store's rows, the cached ones over them
            if not self.built:
                self.build()
            return self.table_caches[name].full_table()["values"]
        if self._stack_quantized:
            return collection_quantization.table_values(self, name)
        stack = self._stack_of(name)
        start = stack.offsets[name]
        value = self._whole(stack, self._stack_tables[stack.name])
        return value[start : start + self.tables[name].input_dim]

    def stats(self, name):
        """The counters of table ``name``'s cache (a table with
        ``cache_rows``), as `AllToAllDenseEmbedding.stats` gives them."""
        if name not in self.table_caches:
            raise ValueError(
                f"Layer '{self.name}': stats() reports the counters of a "
                f"cached table; table {name!r} has none (the tables with "
                f"`cache_rows` are {list(self.table_caches)})."
            )
        if not self.built:
            self.build()
        return self.table_caches[name].stats()

    def set_table(self, name, value):
        """Assigns table ``name``'s rows (``[input_dim, output_dim]``)."""
        if name in self.table_caches and not self.built:
            self.build()  # its store is opened at build
        collection_deltas.written(
            self,
            lambda: collection_state.assign_tables(self, {name: {"embeddings": value}}),
        )

    def export(self, since_step=-1, tables=None):
        """``{table: delta}``: each table's rows changed after step
        ``since_step`` (-1: every row), as
        `AllToAllDenseEmbedding.export` gives them, each named
        ``"<collection>/<table>"`` (``tables``: a subset of the names).
        Needs ``track_changes=True``; `keras_sparse.apply_delta` applies
        them table by table."""
        return collection_deltas.export(self, since_step, tables)

    def save_own_variables(self, store):
        if self._stack_quantized:
            collection_quantization.save(self, store)
            return
        collection_state.save(self, store)

    def load_own_variables(self, store):
        if self._stack_quantized:
            collection_quantization.load(self, store)
            return
        saved = collection_deltas.saved(self, store) if self.track_changes else None
        collection_deltas.written(
            self, lambda: collection_state.load_tables(self, store), saved
        )

    def quantize(self, mode=None, type_check=True, config=None):
        """Makes every table int8 or int4 (Keras's per-row form, see
        `keras_sparse.layers.collection_quantization`); frozen after."""
        collection_quantization.quantize(self, mode, config)

    def quantized_call(self, inputs, weights=None, training=None):
        if training and self.trainable and self.uses_sparse_update:
            raise quantized_rows.training_error(self.name, "a sparse update")
        return self.call(inputs, weights, training)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "tables": {n: c.get_config() for n, c in self.tables.items()},
                "optimizer": None
                if self.sparse_optimizer is None
                else sparse_optimizers.serialize(self.sparse_optimizer),
                "sharding": self.sharding,
            }
        )
        if self.track_changes:
            config["track_changes"] = True
        return config
