"""The dense store of a table with ``cache_rows``, opened and initialized.

`open_store` opens the store of a `keras_sparse.layers.dense_cache.CacheRows`
from its spec (values and optimizer slots per id) under its `DenseMoves`;
`initial_rows` fills it from the table's initializer chunk by chunk.
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.layers.hash.keyed_fresh_rows import key_values
from keras_sparse.layers.hash.keyed_fresh_rows import per_key
from keras_sparse.layers.row_storage import cache_processes
from keras_sparse.layers.row_storage import cache_workers
from keras_sparse.layers.row_storage.cache_checks import check_initializer
from keras_sparse.layers.row_storage.dense_moves import DenseMoves
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.table.sharded_table import key_words


def open_store(cache):
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
    backend = keras.backend.backend()
    if getattr(init, "_init_seed", 0) is None:
        # Unseeded (Keras drew a seed): one seed for every process.
        if backend in ("torch", "jax"):
            seed = cache_processes.shared_seed(cache.owner_name, int(seed))
        elif backend == "tensorflow":
            seed = cache_workers.shared_seed(int(seed))
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
