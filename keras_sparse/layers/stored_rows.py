"""A row store's keys as records: what exports, saves and imports read
from and write to a layer's store beside its table (`keras_sparse.layers.row_tier`).

The store may still hold an older copy of a key the table holds again;
the table's copy wins, so every reader here leaves such keys out.
"""

import keras
import numpy as np

from keras_sparse.layers.row_tier import SCORE
from keras_sparse.layers.row_tier import VALUES
from keras_sparse.layers.row_tier import positions


def evictions(before, result):
    """``(keys, rows, scores)`` of the keys a table call evicted:
    ``before`` the table's ``export()`` ahead of it, ``result`` its
    `InsertResult`."""
    keys = np.asarray(_host(result.evicted_keys), np.int64).reshape(-1)
    rows = np.asarray(_host(result.evicted_rows), np.int64).reshape(-1)
    old_keys, _, old_scores = (np.asarray(_host(x)).reshape(-1) for x in before)
    at = positions(old_keys.astype(np.int64), keys)
    return keys, rows, old_scores[at].astype(np.int64)


def write_back(tier, keys, rows, scores, state):
    """Writes ``keys`` down to ``tier``'s store from their ``rows`` of
    ``state`` (``{"table" | slot name: host array}``), with ``scores``."""
    if not len(keys):
        return
    out = {VALUES: state["table"][rows]}
    out.update({name: v[rows] for name, v in state.items() if name != "table"})
    if tier.scored:
        out[SCORE] = np.asarray(scores, np.int64).reshape(-1, 1)
    with tier.lock:
        tier.store.write(keys, out)


def _host(x):
    return keras.ops.convert_to_numpy(x) if not isinstance(x, np.ndarray) else x


def stored_records(tier, out, include_rows):
    """``out`` (a layer's exported table records) followed by the records
    of the keys ``tier``'s store holds (row -1); keys the table holds are
    left out (their stored rows are older)."""
    parts = {name: [value] for name, value in out.items()}
    for chunk in stored_chunks(tier, out):
        for name, value in chunk.items():
            parts[name].append(value)
    del include_rows  # rows are in ``out`` exactly when asked for
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


def stored_chunks(tier, out, rows_per_chunk=65536):
    """The records of the keys ``tier``'s store holds, at most
    ``rows_per_chunk`` at a time, as dicts of ``out``'s names and dtypes
    (the table's records; ``rows`` -1). Keys ``out`` holds are left out
    (their stored rows are older)."""
    for keys, rows in not_cached(tier.store.chunks(rows_per_chunk), out["keys"]):
        chunk = {"keys": np.asarray(keys, np.int64)}
        for name in out:
            if name == "keys":
                continue
            if name == "rows":
                chunk[name] = np.full(len(keys), -1, out[name].dtype)
            elif name == "scores":
                score = rows.get(SCORE, np.zeros(len(keys), np.int64))
                chunk[name] = score.reshape(-1).astype(out[name].dtype)
            else:
                field = VALUES if name == "values" else name
                chunk[name] = rows[field].astype(out[name].dtype, copy=False)
        yield chunk


def not_cached(chunks, table_keys):
    """Store ``chunks`` (``(keys, rows)``) without the keys in
    ``table_keys`` (the table's copies win over the stored ones)."""
    cached = np.sort(np.asarray(table_keys, np.int64).reshape(-1))
    for keys, rows in chunks:
        if cached.size:
            at = np.minimum(np.searchsorted(cached, keys), cached.size - 1)
            keep = cached[at] != keys
            if not keep.all():
                keys, rows = keys[keep], {k: v[keep] for k, v in rows.items()}
        if keys.size:
            yield keys, rows
