"""Change tracking and delta exports of an `EmbeddingCollection`'s tables.

With ``EmbeddingCollection(..., track_changes=True)`` each stack (and each
table with ``cache_rows``, in its cache) keeps a change step per row
(`keras_sparse.layers.row_changes`), written inside each training step at
the stack's ids. ``export(since_step=s)`` gives one delta per table
(`keras_sparse.layers.dense_deltas`), named ``"<collection>/<table>"``;
`keras_sparse.apply_delta` applies ``{table: delta}`` dicts table by table.
Saves keep each table's steps under ``"<table>:change_steps"``.
"""

import numpy as np
from keras import ops

from keras_sparse.layers import dense_deltas
from keras_sparse.layers import row_changes


def build(layer):
    """Adds the change steps of every stack (cached tables: their caches
    add theirs)."""
    row_changes.check_placement(layer.name)
    for stack in layer.stacks:
        row_changes.add(layer, stack.rows, f"{stack.name}_changes")


def _stack_changes(layer, stack):
    return row_changes.of(layer, f"{stack.name}_changes")


def mark(layer, stack, prepared, iterations):
    """Marks the ids ``stack``'s tables look up in this training step."""
    ids, valid = [], []
    for name in stack.tables:
        table_ids, _, table_valid = prepared[name]
        offset = ops.cast(table_ids, "int32") + stack.offsets[name]
        ids.append(ops.reshape(offset, (-1,)))
        valid.append(ops.reshape(table_valid, (-1,)))
    ids = ops.concatenate(ids, 0) if len(ids) > 1 else ids[0]
    valid = ops.concatenate(valid, 0) if len(valid) > 1 else valid[0]
    row_changes.mark(_stack_changes(layer, stack), ids, valid, iterations + 1)


def step(layer):
    return int(ops.convert_to_numpy(layer.sparse_iterations))


def table_steps(layer, name):
    """Table ``name``'s change steps (NumPy int64, one per row)."""
    if name in layer.table_caches:
        return row_changes.host_steps(row_changes.of(layer.table_caches[name]))
    stack = layer._stack_of(name)
    start = stack.offsets[name]
    steps = row_changes.host_steps(_stack_changes(layer, stack))
    return steps[start : start + layer.tables[name].input_dim]


def table_arrays(layer, name):
    """``{"values"|slot name: [input_dim, ...]}`` of table ``name``."""
    if name in layer.table_caches:
        return layer.table_caches[name].full_table()
    stack = layer._stack_of(name)
    start, rows = stack.offsets[name], layer.tables[name].input_dim
    out = {}
    for entry, variable in layer._named_stack_variables(stack).items():
        field = "values" if entry == "embeddings" else entry[len("slot_") :]
        out[field] = layer._whole(stack, variable)[start : start + rows]
    return out


def export(layer, since_step, tables):
    """`EmbeddingCollection.export`: ``{table: delta}``."""
    if not layer.track_changes:
        raise dense_deltas.not_tracked(layer.name)
    if not layer.built:
        layer.build()
    dense_deltas.check_trainable(layer.name, bool(layer._stack_quantized))
    names = list(layer.tables) if tables is None else list(tables)
    unknown = [n for n in names if n not in layer.tables]
    if unknown:
        raise ValueError(
            f"Layer '{layer.name}': `tables` names unknown table(s) {unknown}; "
            f"the tables are {list(layer.tables)}."
        )
    now = step(layer)
    since = dense_deltas.checked_since(layer.name, since_step, now)
    return {
        name: dense_deltas.delta(
            f"{layer.name}/{name}",
            since,
            now,
            table_steps(layer, name),
            table_arrays(layer, name),
        )
        for name in names
    }


def save(layer, store):
    for name in layer.tables:
        store[f"{name}:{row_changes.SAVED}"] = table_steps(layer, name)


def saved(layer, store):
    """``{table: saved steps}`` of the tables whose steps ``store`` holds."""
    keys, out = set(store.keys()), {}
    for name, config in layer.tables.items():
        entry = f"{name}:{row_changes.SAVED}"
        if entry not in keys:
            continue
        out[name] = np.asarray(store[entry], np.int64)
        if out[name].shape != (config.input_dim,):
            raise ValueError(
                f"Layer '{layer.name}', table '{name}': the saved `{entry}` "
                f"must hold one step per row, shape ({config.input_dim},); "
                f"received {out[name].shape}. Nothing was loaded."
            )
    return out


def written(layer, write, saved_steps=None):
    """Runs ``write()`` (a load or `set_table`) and marks the rows it
    changed (`row_changes.after_write`), per stack and cached table."""
    if not layer.track_changes or not layer.built or layer._stack_quantized:
        return write()  # untracked, or quantized (frozen: writes refused)
    saved_steps = saved_steps or {}
    before, now = {n: table_arrays(layer, n) for n in layer.tables}, step(layer)
    out = write()

    def changed(name):
        after = table_arrays(layer, name)
        return row_changes.changed_rows(
            list(before[name].values()), [after[f] for f in before[name]]
        )

    for name, cache in layer.table_caches.items():
        row_changes.after_write(
            row_changes.of(cache), changed(name), now, saved_steps.get(name)
        )
    for stack in layer.stacks:
        changes = _stack_changes(layer, stack)
        rows = row_changes.host_steps(changes)
        moved = np.zeros(rows.shape, bool)
        for name in stack.tables:
            start = stack.offsets[name]
            end = start + layer.tables[name].input_dim
            moved[start:end] = changed(name)
            if name in saved_steps:
                rows[start:end] = saved_steps[name]
        row_changes.after_write(changes, moved, now, rows)
    return out
