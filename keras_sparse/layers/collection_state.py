"""The per-table state of an `EmbeddingCollection`: its saves (each table
unpadded and unstacked, so a file loads under any grouping), its loads
(weights, and a cached table's rows in the file's asset files) and the
assignment of tables' rows and slots into the stacks and caches."""

import numpy as np

from keras_sparse.layers import collection_deltas
from keras_sparse.layers import placement
from keras_sparse.layers import quantized_rows
from keras_sparse.layers import store_assets
from keras_sparse.layers.record_checks import checked_step_count

#: Weights entry (``"{table}:table_in_assets"``) of a model save whose
#: cached table is in its cache's asset files.
_TABLE_IN_ASSETS = "table_in_assets"


def save(layer, store):
    """Writes every table's state into ``store`` (per table, unpadded and
    unstacked; a cached table's rows in the file's asset files on a model
    save)."""
    # Per table, unpadded and unstacked: loads under any grouping.
    for stack in layer.stacks:
        for var_name, variable in layer._named_stack_variables(stack).items():
            value = layer._whole(stack, variable)
            for name in stack.tables:
                start = stack.offsets[name]
                rows = layer.tables[name].input_dim
                store[f"{name}:{var_name}"] = value[start : start + rows]
    for name, cache in layer.table_caches.items():
        if store_assets.expected():
            # A model save: the cache's `save_assets` streams the table
            # into the file's asset files; the weights only say so.
            store[f"{name}:{_TABLE_IN_ASSETS}"] = np.int64(cache.input_dim)
            continue
        # The whole table (gathered in host memory), as a stack's table.
        table = cache.full_table()
        for entry, field in cached_entries(layer, name).items():
            store[f"{name}:{entry}"] = table[field]
    if layer.uses_sparse_update:
        store["sparse_iterations"] = layer.sparse_iterations.numpy()
    if layer.track_changes:
        collection_deltas.save(layer, store)


def load_tables(layer, store):
    """Assigns every table's state from ``store`` (or raises before any
    change where an entry is missing)."""
    in_assets = tables_in_assets(layer, store)
    # Every entry the layer needs, or nothing is loaded (as Keras refuses
    # a file with missing variables).
    needed = [
        f"{name}:{entry}"
        for name in layer.tables
        if name not in in_assets
        for entry in entries(layer, name)
    ]
    if layer.uses_sparse_update:
        needed.append("sparse_iterations")
    missing = [key for key in needed if key not in store]
    if missing:
        raise ValueError(
            f"Layer '{layer.name}': the saved state has no {missing}; "
            "nothing was loaded. A collection saved without a sparse "
            "optimizer cannot restore one's slots: build it as it was "
            "saved, load, then change it."
        )
    iterations = None
    if layer.uses_sparse_update:
        iterations = checked_step_count(
            layer.name, store["sparse_iterations"], layer.sparse_iterations
        )
    values = {
        name: {entry: store[f"{name}:{entry}"] for entry in entries(layer, name)}
        for name in layer.tables
        if name not in in_assets
    }
    assign_tables(layer, values)
    for name in in_assets:
        # The cache's `load_assets` (called next) streams the table in.
        layer.table_caches[name].table_in_assets = layer.tables[name].input_dim
    if iterations is not None:
        layer.sparse_iterations.assign(iterations)
        for cache in layer.table_caches.values():
            cache.sparse_iterations.assign(iterations)


def tables_in_assets(layer, store):
    """The cached tables whose rows ``store`` (a model save's weights)
    leaves to the file's asset files; raises ValueError before anything
    changes where this load cannot read them."""
    names = [n for n in layer.tables if f"{n}:{_TABLE_IN_ASSETS}" in store]
    for name in names:
        if name not in layer.table_caches:
            raise ValueError(
                f"Layer '{layer.name}', table '{name}': the file holds this "
                "table's rows in its asset files, saved with `cache_rows`; "
                "nothing was loaded. Give the table `cache_rows` (and a "
                "`store`) to load it, then change it."
            )
    if names and not store_assets.expected():
        raise store_assets.missing_assets_error(
            layer.name, sum(layer.tables[n].input_dim for n in names)
        )
    return names


def assign_tables(layer, values):
    """``values``: ``{table: {"embeddings"|"slot_<name>": array}}``.

    Every shape is checked before any variable changes."""
    if layer._stack_quantized:
        raise quantized_rows.training_error(layer.name, "`set_table`")
    cached = {}
    for name, cache in layer.table_caches.items():
        if name not in values:
            continue
        fields = cached_entries(layer, name)
        widths = {"values": layer.tables[name].output_dim}
        widths.update({k: int(v.shape[1]) for k, v in cache.slots.items()})
        for var_name, value in values[name].items():
            want = (layer.tables[name].input_dim, widths[fields[var_name]])
            if np.shape(value) != want:
                raise ValueError(
                    f"Layer '{layer.name}', table '{name}': `{var_name}` "
                    f"must have shape {want}; received {np.shape(value)}."
                )
        cached[name] = {fields[k]: v for k, v in values[name].items()}
    updates = []
    for stack in layer.stacks:
        todo = [n for n in stack.tables if n in values]
        if not todo:
            continue
        for var_name, variable in layer._named_stack_variables(stack).items():
            if not any(var_name in values[n] for n in todo):
                continue
            full = np.array(layer._whole(stack, variable))
            for name in todo:
                if var_name not in values[name]:
                    continue
                value = np.asarray(values[name][var_name])
                want = (layer.tables[name].input_dim,) + full.shape[1:]
                if value.shape != want:
                    raise ValueError(
                        f"Layer '{layer.name}', table '{name}': `{var_name}` "
                        f"must have shape {want}; received {value.shape}."
                    )
                start = stack.offsets[name]
                full[start : start + want[0]] = value
            updates.append((stack, variable, full))
    for stack, variable, full in updates:
        placement.provider().assign_stack_value(stack, variable, full)
    for name, fields in cached.items():
        # Into the store; the cache is emptied (ids refill when trained).
        cache = layer.table_caches[name]
        table = cache.full_table() if len(fields) < len(cache.slots) + 1 else {}
        table.update(fields)
        cache.write_table(table)


def entries(layer, name):
    """The saved entries of table ``name`` (without the table prefix)."""
    if name in layer.table_caches:
        return list(cached_entries(layer, name))
    return list(layer._named_stack_variables(layer._stack_of(name)))


def cached_entries(layer, name):
    """``{saved entry: field of the full table}`` of cached table
    ``name``: the entries of the same table without a cache."""
    entries = {"embeddings": "values"}
    entries.update({f"slot_{k}": k for k in layer.table_caches[name].slots})
    return entries
