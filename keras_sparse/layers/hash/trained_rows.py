"""Read-only key -> row mapping as of a hash layer's last trained step.

A training stage (`keras_sparse.data.prefetch`) maps batches into the table
before their steps run. A read-only call made meanwhile (inference from a
callback, an inference stage) must see the model as the trained steps left
it, as the same run without the stage would: a key that only untrained
batches inserted has no row yet, and a key they evicted or expired
(``ttl_steps``) still owns its old row (which no untrained step has
reset). The stage's undo records of those batches' table calls
(`keras_sparse.data.lookahead`) give both: the rows they touched, and which
key each held before them. Without a stage the mapping is one table
lookup.

Only the layer's own read-only calls (`as_trained`, entered by its ``call``)
resolve keys this way. An inference stage's workers map as before: they may
map while training steps run (a validation stage reading ahead), when the
step counter cannot be read and the trained step is not the one they are
for.
"""

import contextlib
import threading

import numpy as np

from keras_sparse.layers.hash.host_keys import to_numpy

# Tries to read the records and the rows with no table call in between.
_TRIES = 16
_calls = threading.local()  # .layers: ids of layers in `as_trained` here


@contextlib.contextmanager
def as_trained(layer):
    """Within it, this thread's read-only table reads of ``layer`` are as
    of its last trained step."""
    held = getattr(_calls, "layers", None)
    if held is None:
        held = _calls.layers = set()
    fresh = id(layer) not in held
    held.add(id(layer))
    try:
        yield
    finally:
        if fresh:
            held.discard(id(layer))


def read_rows(layer, keys):
    """Rows of flat int64 ``keys`` (the table's array namespace) as of the
    layer's last trained step, -1 where absent; counts nothing."""
    table = layer.table
    hook = layer.stage_lookahead
    if hook is None or id(layer) not in getattr(_calls, "layers", ()):
        return table.lookup(keys, count=False)
    done = layer.trained_steps()
    for _ in range(_TRIES):
        version = table.version
        records = hook(layer, done)
        rows = table.lookup(keys, count=False)
        if table.version == version:  # no key moved in between
            break
    else:
        raise RuntimeError(
            f"Layer '{layer.name}': the prefetch stage kept changing the "
            "hash table while a read-only call read it; call the layer again."
        )
    if not records:
        return rows
    return rows_before(to_numpy(rows), to_numpy(keys), records)


def rows_before(rows, keys, records):
    """``rows`` (int, -1 where absent) of ``keys`` in the table as it is,
    made those of the table before the calls of undo ``records`` (call
    order; see `keras_sparse.table.undo.state_before`, which replays them
    newest first)."""
    touched, was_key, was_live = [], [], []
    for r in reversed(records):  # the order `state_before` replays them in
        new = to_numpy(r.new_rows).astype(np.int64).reshape(-1)
        old = to_numpy(r.evicted_rows).astype(np.int64).reshape(-1)
        touched += [new, old]
        was_key += [np.zeros(new.size, np.int64), to_numpy(r.evicted_keys)]
        was_live += [np.zeros(new.size, bool), np.ones(old.size, bool)]
        if r.ttl is not None:  # after the placements: expired rows reused
            gone = to_numpy(r.ttl.expired_rows).astype(np.int64).reshape(-1)
            touched.append(gone)
            was_key.append(to_numpy(r.ttl.expired_keys).reshape(-1))
            was_live.append(np.ones(gone.size, bool))
    touched = np.concatenate(touched)
    was_key = np.concatenate(was_key).astype(np.int64, copy=False)
    was_live = np.concatenate(was_live)
    # The last write to a row is what it held before the oldest call.
    last = touched.size - 1 - np.unique(touched[::-1], return_index=True)[1]
    touched, was_key, was_live = touched[last], was_key[last], was_live[last]
    out = np.asarray(rows).astype(np.int64).reshape(-1)
    keys = np.asarray(keys).astype(np.int64, copy=False).reshape(-1)
    # A key found at an untouched row was there before; any other key, if
    # live before, was at a row the calls took from it.
    redo = (out < 0) | np.isin(out, touched)
    if redo.any():
        live_keys, live_rows = was_key[was_live], touched[was_live]
        order = np.argsort(live_keys, kind="stable")
        live_keys, live_rows = live_keys[order], live_rows[order]
        q = keys[redo]
        at = np.minimum(np.searchsorted(live_keys, q), max(live_keys.size - 1, 0))
        hit = live_keys[at] == q if live_keys.size else np.zeros(q.size, bool)
        out[redo] = np.where(hit, live_rows[at] if live_keys.size else -1, -1)
    return out.astype(np.asarray(rows).dtype, copy=False).reshape(np.shape(rows))
