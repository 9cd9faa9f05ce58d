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
"""

import keras
import numpy as np
from keras import ops

from keras_sparse import optimizers as sparse_optimizers
from keras_sparse import store as row_stores
from keras_sparse.layers import atomic_save
from keras_sparse.layers import collection_deltas
from keras_sparse.layers import collection_quantization
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import jax_full_keys
from keras_sparse.layers import placement
from keras_sparse.layers import pooling
from keras_sparse.layers import quantized_rows
from keras_sparse.layers import row_changes
from keras_sparse.layers import store_assets
from keras_sparse.layers.arguments import ArgumentError
from keras_sparse.layers.arguments import check_fields
from keras_sparse.layers.arguments import check_known
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.row_storage import cache as cached_rows
from keras_sparse.layers.row_storage import variables as row_variables
from keras_sparse.layers.sparse_embedding_base import _dtype_argument
from keras_sparse.layers.sparse_embedding_base import bag_sums_traced
from keras_sparse.layers.sparse_embedding_base import check_sharding
from keras_sparse.layers.sparse_embedding_base import combine_rows
from keras_sparse.layers.sparse_embedding_base import lookup_flat_rows
from keras_sparse.layers.sparse_embedding_base import sparse_step
from keras_sparse.layers.sparse_embedding_base import table_state
from keras_sparse.layers.table_storage import ARGUMENTS as STORAGE_ARGUMENTS
from keras_sparse.layers.table_storage import TableStorage
from keras_sparse.ops import backend_module


def _check_positive_int(where, name, value):
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value <= 0
    ):
        raise ValueError(
            f"{where}: `{name}` must be a positive integer. Received: "
            f"{name}={value!r} (of type {type(value).__name__})."
        )


class TableConfig:
    """One table of an `EmbeddingCollection`.

    Args:
        input_dim: vocabulary size; ids must be in ``[0, input_dim)``.
        output_dim: embedding width.
        combiner: None (one vector per id), "sum", "mean" or "sqrtn" (pool
            the last axis of the ids), as in `AllToAllDenseEmbedding`.
        embeddings_initializer: initializer of the table's rows.
        sharding: "auto" (the collection's), "data", "table", "row" or
            "column"; used by `keras_sparse.plan` / `keras_sparse.distribution`
            (JAX) and at build under a MirroredStrategy or torch.distributed
            processes.
        cache_rows: None (the table lives in the collection's variables) or
            an int in ``[1, input_dim]``: the device then holds that many
            rows (values and slots), a cache of the ids trained lately, and
            the whole table lives in ``store``, as with
            `AllToAllDenseEmbedding`'s ``cache_rows``. Needs the
            collection's sparse ``optimizer``, one device ("auto" or "data"
            sharding) and a per-id ``embeddings_initializer`` (random or
            constant). Training is exact.
        store: where the whole table lives with ``cache_rows``: "host"
            (default), ``keras_sparse.store.Host()`` or
            ``keras_sparse.store.Disk(path)`` (the table's files go to
            ``path/<collection name>/<table name>``).
        table_dtype: the table's storage dtype, "float32", "bfloat16" or
            "float16" (None: the collection's variable dtype), as
            `AllToAllDenseEmbedding`'s; 16 bits need the collection's sparse
            ``optimizer`` and no ``cache_rows``. Tables of different
            storage never share a stacked variable.
        stochastic_rounding: whether rows written into 16-bit tables and
            slots round stochastically (default) or to nearest.
        slot_dtype: the optimizer slots' storage dtype, as ``table_dtype``.

    Example:

    >>> import keras_sparse as ks
    >>> ks.TableConfig(1000, 8, combiner="sum").input_dim
    1000
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        combiner=None,
        embeddings_initializer="uniform",
        sharding="auto",
        cache_rows=None,
        store=None,
        table_dtype=None,
        stochastic_rounding=True,
        slot_dtype=None,
    ):
        where = "TableConfig"
        self.storage = TableStorage(
            where, table_dtype, stochastic_rounding, slot_dtype, where=where
        )
        self.storage.check_no_store(where, cache_rows, "cache_rows")
        _check_positive_int(where, "input_dim", input_dim)
        _check_positive_int(where, "output_dim", output_dim)
        pooling.check_combiner(where, combiner)
        check_sharding(where, sharding)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.combiner = combiner
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.sharding = sharding
        self.cache_rows = None
        self.store = None
        if cache_rows is not None or store is not None:
            self.store = cached_rows.check_table(
                where,
                self.input_dim,
                cache_rows,
                store,
                sharding,
                self.embeddings_initializer,
            )
            self.cache_rows = int(cache_rows)

    def get_config(self):
        config = {
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "combiner": self.combiner,
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer
            ),
            "sharding": self.sharding,
        }
        if self.cache_rows is not None:
            config["cache_rows"] = self.cache_rows
            config["store"] = row_stores.serialize(self.store)
        if self.storage.config() != TableStorage("").config():
            config.update(self.storage.config())
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return (
            f"TableConfig(input_dim={self.input_dim}, output_dim="
            f"{self.output_dim}, combiner={self.combiner!r}, "
            f"sharding={self.sharding!r}"
            + (
                ""
                if self.cache_rows is None
                else f", cache_rows={self.cache_rows}, store={self.store!r}"
            )
            + "".join(
                f", {k}={v!r}"
                for k, v in self.storage.config().items()
                if v != TableStorage("").config()[k]
            )
            + ")"
        )


class StackInitializer:
    """Draws each table of a stack with its own initializer, in table order,
    and places it at its offset; padding rows are zeros.

    A table gets exactly the values a standalone layer of its shape would
    draw, whatever the stacking (placement, device count).
    """

    def __init__(self, parts, dim):
        self.parts = list(parts)  # (offset, rows, initializer), table order
        self.dim = int(dim)

    def __call__(self, shape, dtype=None):
        backend = keras.backend.backend()
        if backend in ("torch", "tensorflow"):
            return self._fill_in_place(shape, dtype, backend)
        drawn = [
            (offset, init((rows, self.dim), dtype=dtype))
            for offset, rows, init in self.parts
        ]
        if len(drawn) == 1 and drawn[0][0] == 0 and shape[0] == self.parts[0][1]:
            return drawn[0][1]  # one table, no padding: nothing to join
        drawn.sort(key=lambda item: item[0])
        pieces, position = [], 0
        for offset, values in drawn:
            if offset > position:
                pieces.append(ops.zeros((offset - position, self.dim), dtype))
            pieces.append(values)
            position = offset + int(values.shape[0])
        if shape[0] > position:
            pieces.append(ops.zeros((shape[0] - position, self.dim), dtype))
        return ops.concatenate(pieces, axis=0)

    def assign_to(self, variable):
        """Draws the tables into ``variable`` (built as zeros) slice by
        slice: TensorFlow copies an initial value into a new variable, so
        drawing into the variable itself holds one table at a time, not the
        stack twice."""
        for offset, rows, init in self.parts:
            values = init((rows, self.dim), dtype=variable.dtype)
            variable.value[offset : offset + rows].assign(values)

    def _fill_in_place(self, shape, dtype, backend):
        """The stack drawn table by table into one buffer (a torch tensor,
        or a NumPy array TensorFlow's variable adopts), so building it
        holds the stack plus one table, not the stack twice."""
        stack = None
        for offset, rows, init in self.parts:
            values = init((rows, self.dim), dtype=dtype)
            if backend == "torch":
                if stack is None:
                    stack = values.new_zeros(tuple(shape))
                stack[offset : offset + rows].copy_(values)
            else:
                values = ops.convert_to_numpy(values)
                if stack is None:
                    stack = np.zeros(tuple(shape), values.dtype)
                stack[offset : offset + rows] = values
            del values
        return stack


def _assigns_stacks_in_place():
    """Whether stacks are drawn into their variables after building them
    (TensorFlow outside a tf.distribute strategy; see
    `StackInitializer.assign_to`)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.distribute.has_strategy()


_TABLE_FIELDS = (
    "input_dim",
    "output_dim",
    "combiner",
    "embeddings_initializer",
    "sharding",
    "cache_rows",
    "store",
    *STORAGE_ARGUMENTS,
)


def _table_config(layer_name, table, spec):
    if isinstance(spec, TableConfig):
        return spec
    if isinstance(spec, dict):
        check_fields(f"Layer '{layer_name}', table '{table}'", spec, _TABLE_FIELDS)
        try:
            return TableConfig(**spec)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Layer '{layer_name}', table '{table}': {e}") from None
    raise TypeError(
        f"Layer '{layer_name}', table '{table}': expected a "
        f"keras_sparse.TableConfig or a dict of its arguments; received "
        f"{type(spec).__name__}."
    )


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
            configs[name] = _table_config(self.name, name, spec)
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
        self.table_caches = self._table_caches()
        if self.table_caches and keras.backend.backend() != "jax":
            # Host callbacks: no XLA in TensorFlow graphs, eager torch steps.
            self.supports_jit = False
        # JAX without x64: int64 ids beyond int32 are refused before a step.
        jax_full_keys.install()
        # Saves of models holding this layer replace their file atomically.
        atomic_save.install()

    def _table_caches(self):
        """``{name: CacheRows}`` of the tables with ``cache_rows``."""
        caches = {}
        for name, config in self.tables.items():
            if config.cache_rows is None:
                continue
            where = f"Layer '{self.name}', table '{name}'"
            cached_rows.check_layer(where, self.sparse_optimizer)
            if config.sharding == "auto" and self.sharding not in ("auto", "data"):
                raise ValueError(
                    f"{where}: the collection's `sharding`={self.sharding!r} "
                    "applies to this table, which has `cache_rows`: not "
                    "available yet. Give the table sharding='data' (one "
                    "device) or drop its `cache_rows`."
                )
            caches[name] = cached_rows.cached_table(
                f"{self.name}' table '{name}",
                config.input_dim,
                config.output_dim,
                config.cache_rows,
                config.store,
                combiner=config.combiner,
                optimizer=self.sparse_optimizer,
                initializer=config.embeddings_initializer,
                dtype=self.dtype_policy,
                name=f"{self.name}_{name}_cache",
                store_name=f"{self.name}/{name}",
                owner=self,
                track_changes=self.track_changes,
            )
        return caches

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
            assign = _assigns_stacks_in_place()

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
            sums = self._bag_sums(stack, prepared, training, iterations)
            if sums is not None:
                for name, total in sums.items():
                    bag = ops.shape(prepared[name][0])[-1]
                    out = pooling.scale_sum(total, bag, self.tables[name].combiner)
                    outputs[name] = ops.cast(out, self.compute_dtype)
                continue
            rows = self._lookup_stack(stack, prepared, training, iterations)
            for name in stack.tables:
                _, table_weights, valid = prepared[name]
                out = combine_rows(
                    rows[name], table_weights, valid, self.tables[name].combiner
                )
                outputs[name] = ops.cast(out, self.compute_dtype)
        return {name: outputs[name] for name in self.tables}

    def _bag_sums(self, stack, prepared, training, iterations):
        """``{name: [batch, dim] sums of its bags}`` for the tables of
        ``stack`` by the backend's fused gather-and-sum with the sparse update
        (see `SparseEmbeddingBase.bag_sums`), or None where that route does
        not apply: then `_lookup_stack` and the combiners."""
        module = backend_module()
        names = list(stack.tables)
        if (
            iterations is None
            or not hasattr(module, "bag_sums_with_sparse_update")
            or not (self.uses_sparse_update and self.trainable and bool(training))
            or any(self.tables[n].combiner is None for n in names)
            or any(prepared[n][1] is not None for n in names)  # weights
            or not all(
                bag_sums_traced(module, prepared[n][0], [self.tables[n].combiner])
                for n in names
            )
            or placement.provider().route_stack(stack) is not None
        ):
            return None
        table = self._stack_tables[stack.name]
        ids = [prepared[n][0] for n in names]
        if not module.bag_sums_apply(table, ids, [prepared[n][2] for n in names]):
            return None
        sums = module.bag_sums_with_sparse_update(
            table_state(self, table, self._stack_slots[stack.name]),
            [ops.cast(x, "int32") + stack.offsets[n] for x, n in zip(ids, names)],
            iterations,
            row_ranges=[
                (stack.offsets[n], stack.offsets[n] + self.tables[n].input_dim)
                for n in names
            ],
            valids=[prepared[n][2] for n in names],
        )
        cuts = np.cumsum([x.shape[0] for x in ids])[:-1].tolist()
        return dict(zip(names, ops.split(sums, cuts) if cuts else [sums]))

    def _lookup_stack(self, stack, prepared, training, iterations):
        """One lookup for all tables of ``stack``: ``{name: [..., dim] rows}``."""
        ids, valid, shapes = [], [], []
        for name in stack.tables:
            table_ids, _, table_valid = prepared[name]
            shapes.append(table_ids.shape)
            offset_ids = ops.cast(table_ids, "int32") + stack.offsets[name]
            ids.append(ops.where(table_valid, offset_ids, 0))
            valid.append(table_valid)
        routing = placement.provider().route_stack(stack)
        widths = _batch_major_widths(shapes)
        known = all(isinstance(d, int) for s in shapes for d in s)
        if routing is None and known:  # not symbolic (jax.export) nor unknown
            # One device: table after table, so the update (and the gather)
            # walks one table's rows at a time, which the CPU caches hold.
            widths = None
        if widths is not None:
            # [batch, sum of widths]: each device's part of the flat ids is its
            # own batch rows of every table (no resharding before the lookup).
            flat_ids = ops.reshape(
                ops.concatenate(
                    [ops.reshape(x, (-1, w)) for x, w in zip(ids, widths)], 1
                ),
                (-1,),
            )
            flat_valid = ops.reshape(
                ops.concatenate(
                    [ops.reshape(x, (-1, w)) for x, w in zip(valid, widths)], 1
                ),
                (-1,),
            )
        else:
            if any(d is None for s in shapes for d in s):
                raise ValueError(
                    f"Layer '{self.name}': the ids of tables {list(stack.tables)} "
                    f"have shapes {[tuple(s) for s in shapes]}; tables sharing "
                    "a stack need ids with a common first (batch) dimension "
                    "and known other dimensions."
                )
            sizes = [int(np.prod(s)) for s in shapes]
            flat_ids = ops.concatenate([ops.reshape(x, (-1,)) for x in ids], 0)
            flat_valid = ops.concatenate([ops.reshape(x, (-1,)) for x in valid], 0)
        row_ranges = [
            (stack.offsets[n], stack.offsets[n] + self.tables[n].input_dim)
            for n in stack.tables
        ]
        if self._stack_quantized:  # int8/int4 rows, read only
            rows = collection_quantization.gather(self, stack, flat_ids, flat_valid)
        else:
            rows = lookup_flat_rows(
                self,
                self._stack_tables[stack.name],
                self._stack_slots[stack.name],
                flat_ids,
                flat_valid,
                training,
                iterations,
                routing,
                blocks=(widths is not None, widths or sizes, row_ranges),
            )
        if widths is not None:
            rows = ops.reshape(rows, (-1, sum(widths), stack.dim))
            cuts, axis = np.cumsum(widths)[:-1].tolist(), 1
        else:
            cuts, axis = np.cumsum(sizes)[:-1].tolist(), 0
        # (torch rejects an empty list of split points)
        parts = ops.split(rows, cuts, axis=axis) if cuts else [rows]
        out = {}
        for name, part in zip(stack.tables, parts):
            shape = tuple(ops.shape(prepared[name][0])) + (stack.dim,)
            out[name] = ops.reshape(part, shape)
        return out

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

    def _cached_entries(self, name):
        """``{saved entry: field of the full table}`` of cached table
        ``name``: the entries of the same table without a cache."""
        entries = {"embeddings": "values"}
        entries.update({f"slot_{k}": k for k in self.table_caches[name].slots})
        return entries

    def _entries(self, name):
        """The saved entries of table ``name`` (without the table prefix)."""
        if name in self.table_caches:
            return list(self._cached_entries(name))
        return list(self._named_stack_variables(self._stack_of(name)))

    def set_table(self, name, value):
        """Assigns table ``name``'s rows (``[input_dim, output_dim]``)."""
        if name in self.table_caches and not self.built:
            self.build()  # its store is opened at build
        collection_deltas.written(
            self, lambda: self._assign_tables({name: {"embeddings": value}})
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
        # Per table, unpadded and unstacked: loads under any grouping.
        for stack in self.stacks:
            for var_name, variable in self._named_stack_variables(stack).items():
                value = self._whole(stack, variable)
                for name in stack.tables:
                    start = stack.offsets[name]
                    rows = self.tables[name].input_dim
                    store[f"{name}:{var_name}"] = value[start : start + rows]
        for name, cache in self.table_caches.items():
            if store_assets.expected():
                # A model save: the cache's `save_assets` streams the table
                # into the file's asset files; the weights only say so.
                store[f"{name}:{_TABLE_IN_ASSETS}"] = np.int64(cache.input_dim)
                continue
            # The whole table (gathered in host memory), as a stack's table.
            table = cache.full_table()
            for entry, field in self._cached_entries(name).items():
                store[f"{name}:{entry}"] = table[field]
        if self.uses_sparse_update:
            store["sparse_iterations"] = self.sparse_iterations.numpy()
        if self.track_changes:
            collection_deltas.save(self, store)

    def load_own_variables(self, store):
        if self._stack_quantized:
            collection_quantization.load(self, store)
            return
        saved = collection_deltas.saved(self, store) if self.track_changes else None
        collection_deltas.written(self, lambda: self._load_tables(store), saved)

    def _load_tables(self, store):
        in_assets = self._tables_in_assets(store)
        # Every entry the layer needs, or nothing is loaded (as Keras refuses
        # a file with missing variables).
        needed = [
            f"{name}:{entry}"
            for name in self.tables
            if name not in in_assets
            for entry in self._entries(name)
        ]
        if self.uses_sparse_update:
            needed.append("sparse_iterations")
        missing = [key for key in needed if key not in store]
        if missing:
            raise ValueError(
                f"Layer '{self.name}': the saved state has no {missing}; "
                "nothing was loaded. A collection saved without a sparse "
                "optimizer cannot restore one's slots: build it as it was "
                "saved, load, then change it."
            )
        iterations = None
        if self.uses_sparse_update:
            iterations = checked_step_count(
                self.name, store["sparse_iterations"], self.sparse_iterations
            )
        values = {
            name: {entry: store[f"{name}:{entry}"] for entry in self._entries(name)}
            for name in self.tables
            if name not in in_assets
        }
        self._assign_tables(values)
        for name in in_assets:
            # The cache's `load_assets` (called next) streams the table in.
            self.table_caches[name].table_in_assets = self.tables[name].input_dim
        if iterations is not None:
            self.sparse_iterations.assign(iterations)
            for cache in self.table_caches.values():
                cache.sparse_iterations.assign(iterations)

    def _tables_in_assets(self, store):
        """The cached tables whose rows ``store`` (a model save's weights)
        leaves to the file's asset files; raises ValueError before anything
        changes where this load cannot read them."""
        names = [n for n in self.tables if f"{n}:{_TABLE_IN_ASSETS}" in store]
        for name in names:
            if name not in self.table_caches:
                raise ValueError(
                    f"Layer '{self.name}', table '{name}': the file holds this "
                    "table's rows in its asset files, saved with `cache_rows`; "
                    "nothing was loaded. Give the table `cache_rows` (and a "
                    "`store`) to load it, then change it."
                )
        if names and not store_assets.expected():
            raise store_assets.missing_assets_error(
                self.name, sum(self.tables[n].input_dim for n in names)
            )
        return names

    def _assign_tables(self, values):
        """``values``: ``{table: {"embeddings"|"slot_<name>": array}}``.

        Every shape is checked before any variable changes."""
        if self._stack_quantized:
            raise quantized_rows.training_error(self.name, "`set_table`")
        cached = {}
        for name, cache in self.table_caches.items():
            if name not in values:
                continue
            fields = self._cached_entries(name)
            widths = {"values": self.tables[name].output_dim}
            widths.update({k: int(v.shape[1]) for k, v in cache.slots.items()})
            for var_name, value in values[name].items():
                want = (self.tables[name].input_dim, widths[fields[var_name]])
                if np.shape(value) != want:
                    raise ValueError(
                        f"Layer '{self.name}', table '{name}': `{var_name}` "
                        f"must have shape {want}; received {np.shape(value)}."
                    )
            cached[name] = {fields[k]: v for k, v in values[name].items()}
        updates = []
        for stack in self.stacks:
            todo = [n for n in stack.tables if n in values]
            if not todo:
                continue
            for var_name, variable in self._named_stack_variables(stack).items():
                if not any(var_name in values[n] for n in todo):
                    continue
                full = np.array(self._whole(stack, variable))
                for name in todo:
                    if var_name not in values[name]:
                        continue
                    value = np.asarray(values[name][var_name])
                    want = (self.tables[name].input_dim,) + full.shape[1:]
                    if value.shape != want:
                        raise ValueError(
                            f"Layer '{self.name}', table '{name}': `{var_name}` "
                            f"must have shape {want}; received {value.shape}."
                        )
                    start = stack.offsets[name]
                    full[start : start + want[0]] = value
                updates.append((stack, variable, full))
        for stack, variable, full in updates:
            placement.provider().assign_stack_value(stack, variable, full)
        for name, fields in cached.items():
            # Into the store; the cache is emptied (ids refill when trained).
            cache = self.table_caches[name]
            table = cache.full_table() if len(fields) < len(cache.slots) + 1 else {}
            table.update(fields)
            cache.write_table(table)

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


#: Weights entry (``"{table}:table_in_assets"``) of a model save whose
#: cached table is in its cache's asset files.
_TABLE_IN_ASSETS = "table_in_assets"


def _batch_major_widths(shapes):
    """Per-table widths for the ``[batch, width]`` concatenation, or None.

    Needs rank >= 1, known non-batch dims and one batch size (equal, or
    unknown as in a traced step; a model feeds every table the same batch).
    """
    widths, batches = [], set()
    for shape in shapes:
        if len(shape) == 0 or any(d is None for d in shape[1:]):
            return None
        widths.append(int(np.prod(shape[1:], dtype=np.int64)))
        batches.add(shape[0])
    if len({b for b in batches if b is not None}) > 1:
        return None
    return widths
