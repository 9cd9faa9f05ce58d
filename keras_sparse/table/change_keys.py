"""Change steps and removed keys by key (`keras_sparse.table.changes`),
for delta exports and checkpoints of a `HashTable` or `ShardedHashTable`
built with ``track_changes=True``."""

from __future__ import annotations

import numpy as np

from .keys import to_host
from .ttl_keys import _parts

UNKNOWN = np.iinfo(np.int64).max  # change step of a key the table lacks


def _shards(table):
    if getattr(table, "local_shards", None) is None:
        return [table]
    return table.local_shards()


def tracks_changes(table):
    """Whether every local shard of ``table`` keeps change steps."""
    return all(t._impl.__dict__.get("changes") is not None for t in _shards(table))


def horizon(table):
    """The first step whose removals the table knows (see `Changes`)."""
    return max(t._impl.changes.horizon for t in _shards(table))


def keys_changed(table, keys):
    """Change step of each int64 key (NumPy); `UNKNOWN` where the table
    (this process's shards) does not hold it."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    out = np.full(keys.shape, UNKNOWN, np.int64)
    for t, on_device, at in _parts(table, keys):
        with on_device, t._lock:
            impl = t._impl
            rows = impl.find(t._convert(keys[at], "keys")[0])
            steps = impl.xp.where(rows >= 0, impl.changes.steps[rows], UNKNOWN)
            out[at] = to_host(steps)
    return out


def removed_keys(table):
    """``(keys, steps)`` of the keys removed from ``table`` (some may be
    held again), each with the step of its last removal, sorted by key."""
    keys, steps = [], []
    for t, on_device, _ in _parts(table, np.zeros(0, np.int64)):
        with on_device, t._lock:
            k, s = t._impl.changes.compact(t._impl)
        keys.append(k)
        steps.append(s)
    keys, steps = np.concatenate(keys), np.concatenate(steps)
    order = np.argsort(keys, kind="stable")
    return keys[order], steps[order]


def forget_removals(table, step):
    """Drops ``table``'s removal entries at or before ``step`` on every
    local shard (`Changes.forget_through`); returns how many."""
    dropped = 0
    for t, on_device, _ in _parts(table, np.zeros(0, np.int64)):
        with on_device, t._lock:
            dropped += t._impl.changes.forget_through(t._impl, step)
    return dropped


def set_changes(table, keys, steps, gone_keys, gone_steps, since):
    """Loads change steps of the live ``keys`` (steps < 0 leave a key as
    it is), the removal log and its horizon ``since``."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    known = steps >= 0
    keys, steps = keys[known], steps[known]
    for t, on_device, at in _parts(table, keys):
        with on_device, t._lock:
            impl = t._impl
            rows = impl.find(t._convert(keys[at], "keys")[0])
            ok = rows >= 0
            impl.changes.steps[rows[ok]] = impl.xp.asarray(steps[at])[ok]
    gone_keys = np.asarray(gone_keys, np.int64).reshape(-1)
    gone_steps = np.asarray(gone_steps, np.int64).reshape(-1)
    for t, on_device, at in _parts(table, gone_keys):
        with on_device, t._lock:
            t._impl.changes.load(gone_keys[at], gone_steps[at], since)
