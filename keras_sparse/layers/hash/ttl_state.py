"""A hash layer's time to live (``ttl_steps``): its argument and checkpoints.

The table does the expiry (`keras_sparse.table.ttl`). A checkpoint keeps
each saved key's last-seen step (``ttl_last_seen``, aligned with
``record_keys``) next to the table clock it already keeps, so a loaded key
expires at the step it would have without the save. A checkpoint without
them (older, or from a layer without ``ttl_steps``) loads every key as seen
at the saved clock (the load step).
"""

import numpy as np

from keras_sparse.layers.record_checks import checked_int_array
from keras_sparse.table.scores import SCORE_LIMIT
from keras_sparse.table.ttl_keys import keys_last_seen
from keras_sparse.table.ttl_keys import set_keys_last_seen

#: Weights entry of the saved keys' last-seen steps.
ENTRY = "ttl_last_seen"


def checked_ttl_steps(layer_name, ttl_steps, store):
    """``ttl_steps`` as an int (or None); raises ValueError naming the
    layer, the argument and its valid range."""
    if ttl_steps is None:
        return None
    if (
        isinstance(ttl_steps, bool)
        or not isinstance(ttl_steps, (int, np.integer))
        or ttl_steps < 1
    ):
        raise ValueError(
            f"Layer '{layer_name}': `ttl_steps` must be None (keys never "
            "expire) or an integer >= 1 (the training steps a key may go "
            f"unseen before it expires). Received: ttl_steps={ttl_steps!r}."
        )
    if store is not None:
        raise ValueError(
            f"Layer '{layer_name}': `ttl_steps` cannot be combined with "
            "`store=` (an expired key would come back from the store). "
            f"Received: ttl_steps={ttl_steps!r} and a store."
        )
    return int(ttl_steps)


def save(layer, store, keys, trained):
    """Writes the last-seen steps of the saved ``keys`` (``trained``: the
    table as of the last trained step, a `TableState`, or None)."""
    if layer.ttl_steps is None:
        return
    if trained is not None and trained.last_seen is not None:
        seen = np.asarray(trained.last_seen)
        if hasattr(trained.last_seen, "get"):  # CuPy
            seen = trained.last_seen.get()
    else:
        seen = keys_last_seen(layer.table, keys)
    store[ENTRY] = np.asarray(seen, np.int64).reshape(-1)


def checked(layer, store):
    """``(keys, steps)`` saved by `save`, checked before the load changes
    anything; None when the layer has no time to live or the checkpoint no
    steps (every key is then seen at the load step)."""
    names = set(store.keys())
    if layer.ttl_steps is None or ENTRY not in names:
        return None
    keys = np.asarray(store["record_keys"][...], np.int64).reshape(-1)
    steps = checked_int_array(
        layer.name,
        ENTRY,
        store[ENTRY][...],
        (len(keys),),
        "(one last-seen step per saved key; -1: unknown)",
        -1,
        SCORE_LIMIT,
    )
    return keys, steps.astype(np.int64)


def load(layer, saved):
    """Sets the loaded keys' last-seen steps (``saved`` from `checked`)."""
    if saved is not None:
        set_keys_last_seen(layer.table, *saved)
