"""Weights and saves of an `AllToAllDenseEmbedding`.

The table is saved under Keras's key ``"0"`` (so weight files move both
ways between the layer and `keras.layers.Embedding`), then the optimizer
slots (``"slot_<name>"``) and ``"sparse_iterations"``, as unpadded arrays
so that checkpoints load on any mesh. A layer with ``cache_rows`` saves
its whole table under the same entries (or, in a model save that keeps
it in the row cache's assets, ``"table_in_assets"``); `get_weights` and
`set_weights` see that whole table. Quantized and LoRA layers save as
Keras does. Files of keras_sparse 0.1 still load.
"""

import keras
import numpy as np
from keras import ops

from keras_sparse.layers import dense_embedding_deltas as deltas
from keras_sparse.layers import placement
from keras_sparse.layers import row_changes
from keras_sparse.layers.dense_embedding_quantization import keras_state
from keras_sparse.layers.record_checks import checked_step_count

#: Weights entry of a model save whose table is in the row cache's assets.
TABLE_IN_ASSETS = "table_in_assets"


def set_initial_weights(layer, weights):
    """Writes the constructor's ``weights`` (the initial table)."""
    layer.build()
    if isinstance(weights, (list, tuple)) and len(weights) == 1:
        weights = weights[0]
    weights = np.asarray(weights)
    if weights.shape != (layer.input_dim, layer.output_dim):
        raise ValueError(
            f"Layer '{layer.name}': `weights` must have shape "
            f"{(layer.input_dim, layer.output_dim)}; received {weights.shape}."
        )
    if layer.row_cache is not None:  # the store's values; slots unchanged
        table = layer.row_cache.full_table()
        table["values"] = weights
        layer.row_cache.write_table(table)
        return
    if layer.quantization_mode:
        raise ValueError(
            f"Layer '{layer.name}': `weights` cannot initialize a quantized "
            "table; build the float layer, set its weights, then quantize."
        )
    # Padded to the variable's rows when a distribution pads the table
    # (or cut to this device's part).
    hooks = placement.provider()
    hooks.assign_value(
        layer, layer._embeddings, hooks.padded_value(layer, layer._embeddings, weights)
    )


def _cache_entries(layer):
    """``{file entry: full-table field}`` of a layer with ``cache_rows``
    (the entries of the same layer without a cache)."""
    entries = {"0": "values"}
    entries.update({f"slot_{k}": k for k in layer.row_cache.slots})
    return entries


def _cache_vars(layer):
    return [layer.row_cache.embeddings, *layer.row_cache.slots.values()]


def cached_weights(layer):
    """`get_weights` of a layer with ``cache_rows``: the whole table."""
    if not layer.built:
        layer.build()
    table = layer.row_cache.full_table()
    iterations = ops.convert_to_numpy(layer.row_cache.sparse_iterations)
    return [table[f] for f in _cache_entries(layer).values()] + [iterations]


def set_cached_weights(layer, weights):
    """`set_weights` of a layer with ``cache_rows``: the whole table."""
    fields = list(_cache_entries(layer).values())
    shapes = [(layer.input_dim, int(v.shape[1])) for v in _cache_vars(layer)]
    weights = list(weights)
    got = [tuple(np.shape(w)) for w in weights]
    if got != shapes + [()]:
        raise ValueError(
            f"Layer '{layer.name}': set_weights() takes the whole table as "
            f"get_weights() gives it ({fields} then the step count): "
            f"shapes {shapes + [()]}; received {got}. Nothing was set."
        )
    layer.row_cache.write_table(dict(zip(fields, weights)), weights[-1])


def save_own_variables(layer, store):
    if not layer.built:
        return
    if layer._changes() is not None and not keras_state(layer):
        store[row_changes.SAVED] = row_changes.host_steps(layer._changes())
    if layer.row_cache is not None:
        from keras_sparse.layers import store_assets

        if store_assets.expected():  # the table goes in the row cache's assets
            store[TABLE_IN_ASSETS] = np.int64(layer.input_dim)
            store["sparse_iterations"] = ops.convert_to_numpy(
                layer.row_cache.sparse_iterations
            )
            return
        # The whole table under the entries of a layer without a cache.
        table = layer.row_cache.full_table()
        for entry, field in _cache_entries(layer).items():
            store[entry] = table[field]
        store["sparse_iterations"] = ops.convert_to_numpy(
            layer.row_cache.sparse_iterations
        )
        return
    if keras_state(layer):
        keras.layers.Embedding.save_own_variables(layer, store)
        return
    # Unpadded arrays (sharding hook), so checkpoints load on any mesh.
    for name, variable in layer._named_variables().items():
        store[name] = placement.provider().unpadded_value(layer, variable)


def load_own_variables(layer, store):
    if keras_state(layer):
        keras.layers.Embedding.load_own_variables(layer, store)
        return
    saved = None
    if layer.track_changes and row_changes.SAVED in set(store.keys()):
        saved = np.asarray(store[row_changes.SAVED], np.int64)
        if saved.shape != (layer.input_dim,):
            raise ValueError(
                f"Layer '{layer.name}': the saved `{row_changes.SAVED}` must "
                f"hold one step per row, shape ({layer.input_dim},); "
                f"received {saved.shape}. Nothing was loaded."
            )
    deltas.written(layer, lambda: _load_variables(layer, store), saved)


def _load_variables(layer, store):
    if layer.row_cache is not None:
        _load_cached(layer, store)
        return
    named = layer._named_variables()
    if not len(store.keys()):
        store = _store_of_version_0_1(store)
    keys = set(store.keys())
    if "0" not in keys and "embeddings" in keys:  # files of keras_sparse 0.1
        named["embeddings"] = named.pop("0")
    missing = [name for name in named if name not in keys]
    if missing:
        raise ValueError(
            f"Layer '{layer.name}': the saved state has no {missing} "
            f"(it holds {sorted(keys)}); nothing was loaded. A table saved "
            "without a sparse optimizer cannot restore one's slots: "
            "build the layer as it was saved, load, then change it."
        )
    values = {}
    hooks = placement.provider()
    for name, variable in named.items():
        value = np.asarray(hooks.padded_value(layer, variable, store[name]))
        expected = tuple(hooks.loaded_shape(layer, variable))
        if value.shape != expected:
            raise ValueError(
                f"Layer '{layer.name}': saved '{name}' has shape "
                f"{value.shape}, the layer's variable {expected}"
                "; nothing was loaded."
            )
        if name == "sparse_iterations":
            value = checked_step_count(layer.name, value, variable)
        values[name] = value
    for name, variable in named.items():
        hooks.assign_value(layer, variable, values[name])


def _load_cached(layer, store):
    entries = _cache_entries(layer)
    keys = set(store.keys())
    if TABLE_IN_ASSETS in keys:
        from keras_sparse.layers import store_assets

        if not store_assets.expected():
            raise store_assets.missing_assets_error(layer.name, layer.input_dim)
        value = checked_step_count(
            layer.name,
            np.asarray(store["sparse_iterations"]),
            layer.row_cache.sparse_iterations,
        )
        layer.row_cache.sparse_iterations.assign(value)
        # The row cache's `load_assets` (called next) brings the table.
        layer.row_cache.table_in_assets = layer.input_dim
        return
    missing = [e for e in [*entries, "sparse_iterations"] if e not in keys]
    if missing:
        raise ValueError(
            f"Layer '{layer.name}': the saved state has no {missing} "
            f"(it holds {sorted(keys)}); nothing was loaded."
        )
    arrays = {}
    for (entry, field), var in zip(entries.items(), _cache_vars(layer)):
        value = store[entry]
        want = (layer.input_dim, int(var.shape[1]))
        if tuple(value.shape) != want:
            raise ValueError(
                f"Layer '{layer.name}': saved '{entry}' has shape "
                f"{tuple(value.shape)}, the layer's table {want}; nothing "
                "was loaded."
            )
        arrays[field] = value
    layer.row_cache.write_table(arrays, store["sparse_iterations"])


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
