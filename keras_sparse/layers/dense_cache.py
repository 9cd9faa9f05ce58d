"""A fixed-vocabulary table larger than the device: ``cache_rows`` on it.

`AllToAllDenseEmbedding(input_dim, dim, cache_rows=C, store=...)` keeps the
whole ``[input_dim, dim]`` table (values and optimizer slots) in a dense row
store (`keras_sparse.store`: host memory or a file on disk) and only ``C``
rows in its Keras variables: a cache of the ids trained lately. An
`EmbeddingCollection` table of ``TableConfig(cache_rows=C, store=...)``
does the same; both get their `CacheRows` from
`keras_sparse.layers.row_storage.cache`.

Design: a dedicated cache for a fixed vocabulary, no hash table. Its host
map (`keras_sparse.layers.row_storage.dense_slots`) is direct: an int32
slot per id and an id per slot, so a step maps its ids with a few
vectorized NumPy passes over the batch; CLOCK picks the victims, never a
slot the batch uses. A training step then runs three parts:

- the mapping, on the host (an ordered ``io_callback`` in a compiled JAX
  step, a ``tf.numpy_function`` in a TensorFlow graph, a direct call in
  eager steps): ids -> slots, with the slots given to new ids flagged and
  their victims recorded as a plan;
- the moves (`keras_sparse.layers.row_storage.dense_moves`), through the
  in-step glue the hash layer's store uses too
  (`keras_sparse.layers.row_moves.move_rows`): each victim's row (values
  and slots, read from the variables before this step's fills) is written
  to the store, then the new ids' rows are read from the store into their
  slots;
- the layer's ordinary sparse lookup and update (`SparseEmbeddingBase`) on
  the ``[C, dim]`` variables, at the slots.

A fill leaves the id's stored row in place (its write-back overwrites it).
Ids outside ``[0, input_dim)`` raise where the ids are mapped, before the
cache changes (a compiled step aborts with that error), and so does a
batch with more distinct ids than ``cache_rows``. Read-only calls
(inference) map ids without changing the cache and read the ids it does
not hold from the store (`row_moves.read_stored`). The store is
initialized from the layer's ``embeddings_initializer`` chunk by chunk
(`initial_rows`): each id's vector is a function of (seed, id) only, so no
chunk depends on another and no full-size temporary exists.

The full table (store rows overridden by the cached rows) is what
`get_weights`, ``model.save`` and `set_weights`/``load_model`` see.
``model.save`` streams it chunk by chunk into the file's asset files
(`keras_sparse.layers.store_assets`; memory bounded by a chunk) and
``load_model`` streams it back; `get_weights` and ``save_weights`` gather it
in host memory (the entries of a layer without a cache, so weight files
move both ways between the two). An `EmbeddingCollection` saves its cached
tables the same way, each through its cache's assets.

Training is exact: the values and slots of every id equal those of the same
layer without a cache, whatever ``cache_rows`` and the eviction order; only
speed differs.
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_sparse.backend_utils import is_symbolic
from keras_sparse.layers import inputs as input_forms
from keras_sparse.layers import row_moves
from keras_sparse.layers.hash import jax_step_mapping
from keras_sparse.layers.hash.keyed_fresh_rows import key_values
from keras_sparse.layers.hash.keyed_fresh_rows import per_key
from keras_sparse.layers.record_checks import checked_step_count
from keras_sparse.layers.row_storage.cache_checks import check_initializer
from keras_sparse.layers.row_storage.dense_moves import DenseMoves
from keras_sparse.layers.row_storage.dense_slots import DenseSlots
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.layers.sparse_embedding_base import SparseEmbeddingBase
from keras_sparse.table.sharded_table import key_words

#: Bytes of rows written to the store per call when a whole table is set.
_WRITE_BYTES = 64 << 20


class CacheRows(SparseEmbeddingBase):
    """The cache variables, id map and dense store of a table with
    ``cache_rows`` (see the module). The class name places its asset files
    in a model file (``cache_rows``), as files saved before expect."""

    # Model hooks (prefetch, sharding plans) leave it to its owner.
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
        owner=None,
        regularizer=None,
        constraint=None,
    ):
        super().__init__(
            int(cache_rows),
            output_dim,
            # The cache's own rows are never read before a fill.
            "zeros",
            regularizer,
            constraint,
            combiner=combiner,
            optimizer=optimizer,
            sharding="data",
            name=name,
            dtype=dtype,
        )
        # Errors read "Layer '{owner_name}': ...".
        self.owner_name = label
        self.input_dim = int(input_dim)
        self.capacity = int(cache_rows)
        self.spec = spec
        # The store's folder name (under a `Disk` spec's path).
        self.store_name = store_name
        self.store_initializer = initializer
        self.slot_map = DenseSlots(label, input_dim, cache_rows)
        self.row_tier = None
        # The layer calling this one (a weak reference: not a sublayer).
        self._owner = None if owner is None else weakref.ref(owner)

    def build(self, input_shape=None):
        if self.built:
            return
        self.embeddings = self._build_table()
        self.row_tier = _dense_tier(self)
        self.built = True

    # ---------------------------------------------------------------- call
    def call(self, inputs, weights=None, training=None):
        ids, weights, use = input_forms.fixed_vocabulary_ids(
            self.owner_name, inputs, weights, self.input_dim, self.combiner,
            in_range=False,
        )  # fmt: skip
        shape = tuple(ids.shape)
        if None in shape:  # TF graphs with an unknown batch size
            shape = tuple(ops.shape(ids))
        flat = ops.reshape(ids, (-1,))
        use = ops.reshape(use, (-1,))
        insert = bool(training) and self.trainable
        slots, fill = self._map(flat, use, insert)
        if insert:
            row_moves.move_rows(self, slots, fill, self._route())
            vectors = self.lookup_rows(slots, use, training)
            valid = use
        else:
            cached = slots >= 0
            vectors = self.lookup_rows(slots, cached, training)
            # Ids the cache does not hold: read from the store (-2: unused).
            rows = ops.where(use, slots, -2)
            found, values = row_moves.read_stored(self, flat, rows)
            vectors = ops.where(ops.expand_dims(found, -1), values, vectors)
            valid = ops.logical_or(cached, found)
        vectors = ops.reshape(vectors, shape + (self.output_dim,))
        out = self.combine(vectors, weights, ops.reshape(valid, shape))
        return ops.cast(out, self.compute_dtype)

    def _map(self, flat, use, insert):
        """Flat ``(slots int32, fill bool)`` of ``flat`` ids where ``use``
        (see `DenseSlots.assign`; read-only: `DenseSlots.lookup`)."""

        def host(ids, used):
            ids = np.asarray(ids).reshape(-1)
            used = np.asarray(used, bool).reshape(-1)
            if not insert:
                slots = self.slot_map.lookup(ids, used)
                return slots, np.zeros(slots.shape, bool)
            with self.row_tier.lock:
                slots, fill, evicted = self.slot_map.assign(ids, used)
                self.row_tier.record(ids, fill, evicted)
            return slots, fill

        if not is_symbolic(flat):
            if _in_shape_inference():  # placeholder values: map nothing
                return ops.full_like(use, -1, "int32"), ops.zeros_like(use)
            out = host(ops.convert_to_numpy(flat), ops.convert_to_numpy(use))
            return tuple(ops.convert_to_tensor(x) for x in out)
        n = None if None in tuple(flat.shape) else int(flat.shape[0])
        backend = keras.backend.backend()
        if backend == "jax":

            def host_rows(ids, used, out):
                out[0][...], out[1][...] = host(ids, used)

            return jax_step_mapping.rows_in_step(
                self, self._route(), flat, use, n, host_rows, None
            )
        if backend == "tensorflow":
            import tensorflow as tf

            slots, fill = tf.numpy_function(
                host, [flat, use], [tf.int32, tf.bool], stateful=True
            )
            slots.set_shape((n,))
            fill.set_shape((n,))
            return slots, fill
        raise NotImplementedError(
            f"Layer '{self.owner_name}': compiled steps are not supported on "
            f"the {backend} backend with `cache_rows`; use jit_compile=False."
        )

    def _route(self):
        """How a compiled JAX step reaches the host: in-place buffer
        callbacks ("cpu_buffers") where the step runs on one CPU device
        and calls the owner once (the callbacks are unordered), else
        ordered ``io_callback``s (as `jax_step_mapping.choose_route`)."""
        if keras.backend.backend() != "jax":
            return "io_callback"
        import jax

        owner = None if self._owner is None else self._owner()
        if (
            not jax_step_mapping.IN_PLACE_CALLBACKS
            or jax_step_mapping.buffer_callback_or_none() is None
            or keras.distribution.distribution() is not None
            or len(getattr(owner, "_inbound_nodes", ())) > 1
            or jax.default_backend() != "cpu"
        ):
            return "io_callback"
        return "cpu_buffers"

    def _full_keys(self, ids):
        # `row_moves.read_stored`'s keys: ids of a fixed vocabulary fit in
        # the step's integers as they are.
        return np.asarray(ids, np.int64)

    # ---------------------------------------------------------------- state
    def _host_state(self):
        """NumPy copies of the cache's variables ("table" / slot name)."""
        state = {"table": ops.convert_to_numpy(self.embeddings)}
        state.update({k: ops.convert_to_numpy(v) for k, v in self.slots.items()})
        return state

    def stats(self):
        """The cache's counters (``hits``/``misses`` of the ids of training
        calls, a repeat within a call being a hit; ``evictions``), ``size``
        and ``capacity``, and its store's (``fills``, ``write_backs``,
        ``store_hits``, ``store_size``, ``store_bytes``)."""
        slot_map = self.slot_map
        out = dict(slot_map.counts)
        out["inserts"] = out["misses"]
        out.update(size=slot_map.size, capacity=slot_map.capacity)
        out.update(self.row_tier.stats())
        return out

    def export(self):
        """The whole table as records: ``{"keys": every id, "values",
        <slot name>...}`` (`full_table`)."""
        table = self.full_table()
        out = {"keys": np.arange(self.input_dim, dtype=np.int64)}
        out["values"] = table.pop(VALUES)
        out.update(table)
        return out

    def flush_store(self):
        """Writes the cached rows down to the store, empties the cache and
        flushes the store (it then holds the whole trained table)."""
        tier = self.row_tier
        with tier.lock:
            if tier.pending():
                raise ValueError(
                    f"Layer '{self.owner_name}': flush_store(): "
                    f"{tier.pending()} batch(es) were mapped but not trained."
                )
            ids, slots = self.slot_map.cached()
            if ids.size:
                state = self._host_state()
                out = {VALUES: state["table"][slots]}
                out.update({name: state[name][slots] for name in self.slots})
                tier.store.write(ids, out)
            self.slot_map.clear()
            tier.store.flush()

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
            ids, slots = self.slot_map.cached()
            state = self._host_state() if ids.size else {}
            chunks = _overridden(
                tier.store.chunks(store_assets.rows_per_chunk(fields)),
                ids,
                slots,
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
            self.slot_map.clear()
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
            ids, slots = self.slot_map.cached()
            if ids.size:
                state = self._host_state()
                out[VALUES][ids] = state["table"][slots]
                for name in self.slots:
                    out[name][ids] = state[name][slots]
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
            self.slot_map.clear()
            for first in range(0, self.input_dim, step):
                end = min(first + step, self.input_dim)
                rows = {f.name: np.asarray(arrays[f.name][first:end]) for f in fields}
                tier.store.write(np.arange(first, end, dtype=np.int64), rows)
        if iterations is not None:
            value = checked_step_count(
                self.owner_name, np.asarray(iterations), self.sparse_iterations
            )
            self.sparse_iterations.assign(value)


def _in_shape_inference():
    """True inside Keras' ``compute_output_spec`` (placeholder values)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def _dense_tier(cache):
    """The `DenseMoves` over a new dense store of ``cache``'s full table."""
    from keras_sparse import store as row_stores

    dim = cache.output_dim
    fields = [row_stores.FieldSpec(VALUES, dim, _dtype(cache.embeddings))]
    for name, var in cache.slots.items():
        fields.append(row_stores.FieldSpec(name, int(var.shape[1]), _dtype(var)))
    init = initial_rows(cache, fields)
    store = cache.spec.open_dense(
        tuple(fields), cache.input_dim, init, name=cache.store_name
    )
    return DenseMoves(cache.owner_name, store, cache.slots)


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


def initial_rows(cache, fields):
    """``initializer(first, end)`` of the dense store: the rows of ids
    ``[first, end)``. Values: per id from (seed, id) for random
    initializers (`keyed_fresh_rows`, with the fans of the whole
    ``[input_dim, dim]`` table), a constant's value otherwise; slots: their
    initial values."""
    init = cache.store_initializer
    check_initializer(f"Layer '{cache.owner_name}'", init)
    dim, num_rows = cache.output_dim, cache.input_dim
    values_dtype = next(f.dtype for f in fields if f.name == VALUES)
    seed = getattr(init, "seed", None)
    if not isinstance(seed, (int, np.integer)):
        seed = int(np.random.default_rng(seed=None).integers(1, 2**31 - 1))
    slot_values = {
        spec.name: spec.initial_value for spec in cache.sparse_optimizer.slot_specs()
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
