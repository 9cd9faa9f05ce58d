"""A fixed-vocabulary table larger than the device: ``cache_rows`` on it.

`AllToAllDenseEmbedding(input_dim, dim, cache_rows=C, store=...)` keeps the
whole ``[input_dim, dim]`` table (values and optimizer slots) in a dense row
store (`keras_sparse.store`: host memory or a file on disk) and only ``C``
rows in its Keras variables: a cache of the ids trained lately. An
`EmbeddingCollection` table of ``TableConfig(cache_rows=C, store=...)``
does the same; both get their `CacheRows` from
`keras_sparse.layers.row_storage.cache`.

Design: composition. The dense layer holds a `CacheRows`, a
`DistributedHashEmbedding` whose keys are the ids, over a dense store (LRU,
admitted at first sight). Everything a step does with the cache is the hash
layer's own machinery, unchanged: the key->row mapping wherever the step
runs (eager, a compiled JAX step, a TensorFlow graph), the move plans of
`keras_sparse.layers.row_tier` (write-backs of evicted ids, then fills) and
their in-step glue `keras_sparse.layers.row_moves`, the sparse update, the
read-only path for inference (`read_missing`) and the counters. A shared
"cached rows" component carved out of the hash layer would have meant
moving that machinery around; composition adds only what a fixed
vocabulary differs in:

- every id is present in a dense store: a fill never misses, so no fresh
  row is ever drawn (the mapper's initializer is zeros and unused), and a
  fill leaves the id's stored row in place (`RowTier(dense=True)`);
- the store is initialized from the layer's ``embeddings_initializer`` chunk
  by chunk (`initial_rows`): each id's vector is a function of (seed, id)
  only, so no chunk depends on another and no full-size temporary exists;
- ids outside ``[0, input_dim)`` raise where the ids are mapped, before the
  table changes (a compiled step aborts with that error), and a batch whose
  ids do not all find a cache row raises instead of training part of it;
- inference never reads the serving map (it would need refreshing by model
  hooks that look for hash layers): ids are mapped on the host, and ids not
  cached are read from the store;
- the full table (store rows overridden by the cached rows) is what
  `get_weights`, ``model.save`` and `set_weights`/``load_model`` see.
  ``model.save`` streams it chunk by chunk into the file's asset files
  (`keras_sparse.layers.store_assets`; memory bounded by a chunk) and
  ``load_model`` streams it back; `get_weights` and ``save_weights`` gather
  it in host memory (the entries of a layer without a cache, so weight
  files move both ways between the two). An `EmbeddingCollection` saves
  its cached tables the same way, each through its cache's assets.

Training is exact: the values and slots of every id equal those of the same
layer without a cache, whatever ``cache_rows``; only speed differs.
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.layers.hash import key_mapping
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from keras_sparse.layers.hash.keyed_fresh_rows import has_seed
from keras_sparse.layers.hash.keyed_fresh_rows import key_values
from keras_sparse.layers.hash.keyed_fresh_rows import per_key
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.layers.row_tier import RowTier
from keras_sparse.table.sharded_table import key_words

#: Bytes of rows written to the store per call when a whole table is set.
_WRITE_BYTES = 64 << 20
_CONSTANT_INITS = (
    keras.initializers.Zeros,
    keras.initializers.Ones,
    keras.initializers.Constant,
)


def check_arguments(
    where, input_dim, cache_rows, store, optimizer, sharding, **refused
):
    """The store spec of a table given ``cache_rows``; raises ValueError
    naming the argument when the cache cannot keep the table exact.
    ``where``: how errors name the table ("Layer 'ids'")."""
    check_cache_rows(where, input_dim, cache_rows, store)
    check_optimizer(where, optimizer)
    check_sharding(where, sharding)
    for arg, value in refused.items():
        if value:
            raise ValueError(
                f"{where}: `{arg}`={value!r} is not available with "
                f"`cache_rows` (a table cached on the device trains with the "
                f"layer's sparse optimizer only). Drop `{arg}` or `cache_rows`."
            )
    return store_spec(where, store)


def check_optimizer(where, optimizer):
    """Refuses ``optimizer=None`` (dense gradients) with ``cache_rows``."""
    if optimizer is None:
        raise ValueError(
            f"{where}: `cache_rows` needs a sparse `optimizer` (e.g. "
            "'adagrad'): the cached rows change ids as they are evicted, so "
            "the layer updates them itself, not the model's optimizer. "
            "Received: optimizer=None."
        )


def check_sharding(where, sharding):
    """Refuses the strategies a cached table does not support yet."""
    if sharding not in ("auto", "data"):
        raise ValueError(
            f"{where}: `sharding`={sharding!r} is not available with "
            "`cache_rows` yet: use 'data' or 'auto' (one device)."
        )


def store_spec(where, store):
    """The `keras_sparse.store` spec ``store`` names ("host" when None)."""
    from keras_sparse import store as row_stores

    try:
        return row_stores.get("host" if store is None else store)
    except ValueError as e:
        raise ValueError(f"{where}: `store`: {e}") from None


def check_cache_rows(where, input_dim, cache_rows, store):
    """Raises ValueError unless ``cache_rows`` is an int in [1, input_dim]
    (a ``store`` needs one)."""
    if cache_rows is None:
        raise ValueError(
            f"{where}: `store`={store!r} needs `cache_rows` (the rows the "
            "device holds, 1 <= cache_rows <= input_dim)."
        )
    if (
        not isinstance(cache_rows, (int, np.integer))
        or isinstance(cache_rows, bool)
        or not 1 <= cache_rows <= input_dim
    ):
        raise ValueError(
            f"{where}: `cache_rows` must be an integer in [1, input_dim="
            f"{input_dim}]. Received: cache_rows={cache_rows!r}."
        )


def check_initializer(where, initializer):
    """Refuses initializers with no per-id form (their values for one chunk
    would depend on the chunk)."""
    if per_key(initializer) or (
        isinstance(initializer, _CONSTANT_INITS) and not has_seed(initializer)
    ):
        return
    raise ValueError(
        f"{where}: with `cache_rows` the table is initialized chunk by "
        "chunk, each id's row a function of (seed, id): "
        "`embeddings_initializer` must be RandomUniform, RandomNormal, "
        "TruncatedNormal, a VarianceScaling initializer (Glorot, He, Lecun) "
        f"or a constant; received {type(initializer).__name__}."
    )


def check_one_device(name):
    """Refuses a Keras distribution over several devices (JAX)."""
    dist = keras.distribution.distribution()
    devices = getattr(getattr(dist, "device_mesh", None), "devices", None)
    if devices is not None and np.size(devices) > 1:
        raise ValueError(
            f"Layer '{name}': `cache_rows` is not available under a "
            f"distribution over {np.size(devices)} devices yet (`sharding`): "
            "build and train the layer on one device."
        )


class CacheRows(DistributedHashEmbedding):
    """The id -> cache row map, cache variables and dense store of an
    `AllToAllDenseEmbedding` with ``cache_rows`` (see the module)."""

    # Not "hash": model hooks (prefetch, serving maps, full 64-bit keys)
    # look for hash layers fed by model inputs; this one is fed by its owner.
    keras_sparse_kind = "dense_cache"

    def __init__(
        self,
        label,
        input_dim,
        output_dim,
        cache_rows,
        spec,
        *,
        combiner,
        optimizer,
        initializer,
        dtype,
        name,
        store_name,
        regularizer=None,
        constraint=None,
    ):
        super().__init__(
            output_dim,
            capacity=int(cache_rows),
            combiner=combiner,
            optimizer=optimizer,
            # Never drawn: a dense store fills every fresh row.
            embeddings_initializer="zeros",
            embeddings_regularizer=regularizer,
            eviction="lru",
            sharding="data",
            name=name,
            dtype=dtype,
        )
        self.embeddings_constraint = constraint
        # Errors read "Layer '{owner_name}': ...".
        self.owner_name = label
        self.input_dim = input_dim
        self.spec = spec
        # The store's folder name (under a `Disk` spec's path).
        self.store_name = store_name
        self.store_initializer = initializer

    def build(self, input_shape=None):
        built = self.built
        super().build(input_shape)
        if not built:
            self.row_tier = _dense_tier(self)

    # ------------------------------------------------------------- mapping
    def _map_keys(self, keys, use, insert, inference=False):
        # Never the serving map: nothing refreshes it for this layer.
        return key_mapping.map_keys(self, keys, use, insert, inference=False)

    def _table_rows(self, flat, use, insert, xp, out=None, undo=None):
        picked = np.asarray(flat if use is None else flat[np.asarray(use, bool)])
        bad = (picked < 0) | (picked >= self.input_dim)
        if bad.any():
            raise ValueError(
                f"Layer '{self.owner_name}': id {int(picked[bad][0])} is out of "
                f"range; valid ids are in [0, {self.input_dim}) (input_dim="
                f"{self.input_dim}). {int(bad.sum())} id(s) out of range in "
                "this batch; the cache and its store were not changed."
            )
        rows, fresh = super()._table_rows(flat, use, insert, xp, out, undo)
        if insert:
            lost = rows < 0
            if use is not None:
                lost &= np.asarray(use, bool)
            if lost.any():
                raise RuntimeError(
                    f"Layer '{self.owner_name}': {int(lost.sum())} id(s) of this "
                    "batch found no cache row (their candidate buckets were "
                    f"full of this batch's ids; cache_rows={self.capacity}). "
                    "Use a larger `cache_rows` or a smaller batch, and restore "
                    "the model from a checkpoint."
                )
        return rows, fresh

    # ---------------------------------------------------------------- state
    # The owner saves the full table; this layer's variables are its cache.
    def save_own_variables(self, store):
        pass

    def load_own_variables(self, store):
        pass

    # A model save: the full table into the asset files, chunk by chunk.
    def save_assets(self, dir_path):
        from keras_sparse.layers import store_assets

        tier = self.row_tier
        if tier is None or not store_assets.expected():
            return  # unbuilt: no store, nothing trained to save
        fields = tier.store.fields
        with tier.lock:
            keys, rows, _ = (np.asarray(x) for x in self.table.export())
            order = np.argsort(keys)
            keys, rows = keys[order], rows[order]
            state = self._host_state() if keys.size else {}
            chunks = _overridden(
                tier.store.chunks(store_assets.rows_per_chunk(fields)),
                keys,
                rows,
                {VALUES: "table", **{n: n for n in self.slots}},
                state,
            )
            store_assets.save(self.owner_name, fields, chunks, self.input_dim, dir_path)

    def load_assets(self, dir_path):
        from keras_sparse.layers import store_assets

        expected, self.table_in_assets = getattr(self, "table_in_assets", None), None
        if expected is None:
            return
        saved = store_assets.saved_rows(dir_path)
        if saved != self.input_dim:
            raise ValueError(
                f"Layer '{self.owner_name}': the file's asset files hold {saved} "
                f"rows of its table (None: none), not input_dim="
                f"{self.input_dim}; the file is incomplete."
            )
        tier = self.row_tier
        with tier.lock:
            tier.drop_plans()
            self.table.clear()
            store_assets.load(
                self.owner_name, tier.store.fields, dir_path, tier.store.write
            )

    def full_table(self):
        """``{"values" | slot name: [input_dim, width]}``: the store's rows
        overridden by the cached ones (gathered in host memory)."""
        tier = self.row_tier
        with tier.lock:
            fields = tier.store.fields
            out = {f.name: np.empty((self.input_dim, f.width), f.dtype) for f in fields}
            for ids, rows in tier.store.chunks():
                for f in fields:
                    out[f.name][ids] = rows[f.name]
            keys, rows, _ = (np.asarray(x) for x in self.table.export())
            if keys.size:
                state = self._host_state()
                out[VALUES][keys] = state["table"][rows]
                for name in self.slots:
                    out[name][keys] = state[name][rows]
        return out

    def write_table(self, arrays, iterations=None):
        """Sets the full table (``arrays`` as `full_table` gives, NumPy or
        anything sliceable): into the store chunk by chunk; the cache is
        emptied (every id is filled from the store when next trained)."""
        tier = self.row_tier
        fields = tier.store.fields
        step = max(1, _WRITE_BYTES // sum(f.row_bytes for f in fields))
        with tier.lock:
            tier.drop_plans()
            self.table.clear()
            for first in range(0, self.input_dim, step):
                end = min(first + step, self.input_dim)
                rows = {f.name: np.asarray(arrays[f.name][first:end]) for f in fields}
                tier.store.write(np.arange(first, end, dtype=np.int64), rows)
        if iterations is not None:
            value = checked_step_count(
                self.owner_name, np.asarray(iterations), self.sparse_iterations
            )
            self.sparse_iterations.assign(value)


def _overridden(chunks, keys, rows, names, state):
    """``chunks`` of a dense store with the rows of the cached ids ``keys``
    (ascending; at cache ``rows``) taken from ``state`` ({``names``[field]:
    host array}): the full table, chunk by chunk."""
    for ids, got in chunks:
        if keys.size:
            at = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
            hit = keys[at] == ids
            if hit.any():
                got = {name: np.array(value) for name, value in got.items()}
                for field, name in names.items():
                    got[field][hit] = state[name][rows[at[hit]]]
        yield ids, got


def _dense_tier(mapper):
    """A `RowTier` over a new dense store of ``mapper``'s full table."""
    from keras_sparse import store as row_stores

    dim = mapper.output_dim
    fields = [row_stores.FieldSpec(VALUES, dim, _dtype(mapper.embeddings))]
    for name, var in mapper.slots.items():
        fields.append(row_stores.FieldSpec(name, int(var.shape[1]), _dtype(var)))
    init = initial_rows(mapper, fields)
    store = mapper.spec.open_dense(
        tuple(fields), mapper.input_dim, init, name=mapper.store_name
    )
    # No `set_held_keys`: every id is admitted at first sight anyway (LRU,
    # admit_after=1), and a dense store holds every id.
    return RowTier(mapper.owner_name, store, mapper.slots, dense=True)


def initial_rows(mapper, fields):
    """``initializer(first, end)`` of the dense store: the rows of ids
    ``[first, end)``. Values: per id from (seed, id) for random
    initializers (`keyed_fresh_rows`, with the fans of the whole
    ``[input_dim, dim]`` table), a constant's value otherwise; slots: their
    initial values."""
    init = mapper.store_initializer
    check_initializer(f"Layer '{mapper.owner_name}'", init)
    dim, num_rows = mapper.output_dim, mapper.input_dim
    values_dtype = next(f.dtype for f in fields if f.name == VALUES)
    seed = getattr(init, "seed", None)
    if not isinstance(seed, (int, np.integer)):
        seed = int(np.random.default_rng(seed=None).integers(1, 2**31 - 1))
    slot_values = {
        spec.name: spec.initial_value for spec in mapper.sparse_optimizer.slot_specs()
    }

    def rows(first, end):
        n = end - first
        if per_key(init):
            words = key_words(np.arange(first, end, dtype=np.int64))
            values = key_values(
                init, words, dim, values_dtype, int(seed), (num_rows, dim)
            )
        else:
            values = init((n, dim), dtype=values_dtype)
        out = {VALUES: ops.convert_to_numpy(values)}
        for f in fields:
            if f.name != VALUES:
                out[f.name] = np.full((n, f.width), slot_values[f.name], f.dtype)
        return out

    return rows


def _dtype(variable):
    return np.dtype(str(variable.dtype).split(".")[-1]).name
