"""Change tracking of an `AllToAllDenseEmbedding`'s whole-table writes and
its delta exports (``track_changes=True``).

Training steps mark the rows they change inside the step
(`keras_sparse.layers.row_changes`); a set or load of the whole table
marks the rows it changed (`written`). ``export(since_step=s)`` returns
the rows changed after ``s`` (`keras_sparse.layers.dense_deltas`).
"""

import numpy as np

from keras_sparse.layers import dense_deltas
from keras_sparse.layers import placement
from keras_sparse.layers import row_changes


def table_arrays(layer):
    """``{"values"|slot name: [input_dim, ...]}`` of the whole table."""
    if layer.row_cache is not None:
        return layer.row_cache.full_table()
    hooks = placement.provider()
    named = layer._named_variables()
    out = {"values": np.asarray(hooks.unpadded_value(layer, named["0"]))}
    for name, slot in layer.slots.items():
        out[name] = np.asarray(hooks.unpadded_value(layer, slot))
    return out


def export(layer, since_step):
    """The layer's ``export``: the rows changed after ``since_step``."""
    if not layer.track_changes:
        raise dense_deltas.not_tracked(layer.name)
    if not layer.built:
        layer.build()
    dense_deltas.check_trainable(layer.name, layer.quantization_mode)
    step = layer._step()
    since = dense_deltas.checked_since(layer.name, since_step, step)
    steps = row_changes.host_steps(layer._changes())
    return dense_deltas.delta(layer.name, since, step, steps, table_arrays(layer))


def written(layer, write, saved_steps=None):
    """Runs ``write()`` (a set or load of the whole table); with
    tracking, marks the rows it changed (`row_changes.after_write`)."""
    if layer._changes() is None or layer.quantization_mode:  # none, or frozen
        return write()
    before, step = table_arrays(layer), layer._step()
    out = write()
    after = table_arrays(layer)
    changed = row_changes.changed_rows(list(before.values()), list(after.values()))
    row_changes.after_write(layer._changes(), changed, step, saved_steps)
    return out
