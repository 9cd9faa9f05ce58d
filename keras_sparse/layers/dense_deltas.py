"""Delta exports of fixed-vocabulary tables: the rows changed after a step.

``AllToAllDenseEmbedding(..., track_changes=True).export(since_step=s)``
(and ``EmbeddingCollection.export``, one per table) returns the rows whose
change step (`keras_sparse.layers.row_changes`) is after ``s``: ``keys``
(the row ids, int64), ``values`` and each optimizer slot by name, in the
form of a hash layer's delta (`keras_sparse.layers.hash.deltas`), so that
`keras_sparse.apply_delta` applies them in order::

    full = layer.export(since_step=-1)         # every row
    ...                                        # train
    d1 = layer.export(since_step=int(full["step"]))
    apply_delta(full, d1)                      # == layer.export(since_step=-1)

A fixed vocabulary removes no rows: ``removed_keys`` is always empty.
Steps are the layer's ``sparse_iterations`` (its training steps).
"""

import numpy as np

from keras_sparse.layers.hash.deltas import FULL


def checked_since(layer_name, since_step, step):
    """Raises ValueError unless ``since_step`` is -1 or in ``[0, step]``."""
    if (
        isinstance(since_step, bool)
        or not isinstance(since_step, (int, np.integer))
        or not (since_step == FULL or 0 <= since_step <= step)
    ):
        raise ValueError(
            f"Layer '{layer_name}': `since_step` must be -1 (every row) or an "
            f"integer in [0, {step}] (up to the layer's current step). "
            f"Received: since_step={since_step!r}."
        )
    return int(since_step)


def not_tracked(layer_name):
    return ValueError(
        f"Layer '{layer_name}': `export(since_step=...)` needs the layer built "
        "with `track_changes=True` (each row then keeps the step it last "
        "changed at); this layer has track_changes=False."
    )


def check_trainable(layer_name, quantized):
    """A quantized (frozen) table has no steps to export from."""
    if quantized:
        raise ValueError(
            f"Layer '{layer_name}': `export(since_step=...)` needs the float "
            "table; this layer is quantized (frozen, its training state "
            "dropped). Export the deltas before `quantize`."
        )


def delta(name, since_step, step, steps, arrays):
    """The delta of one table: ``arrays`` (``{"values"|slot: [rows, ...]}``
    NumPy) at the rows whose ``steps`` are after ``since_step``."""
    if since_step == FULL:
        keep = np.ones(steps.shape, bool)
    else:
        keep = steps > since_step
    ids = np.flatnonzero(keep).astype(np.int64)
    out = {"keys": ids}
    for field, value in arrays.items():
        out[field] = np.asarray(value)[ids]
    out["removed_keys"] = ids[:0]
    out.update(
        layer=np.str_(name),
        since_step=np.int64(since_step),
        step=np.int64(step),
        dtype=np.str_(out["values"].dtype.name),
    )
    return out
