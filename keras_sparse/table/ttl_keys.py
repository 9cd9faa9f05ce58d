"""Last-seen steps by key (`keras_sparse.table.ttl`), for checkpoints of
a `HashTable` or `ShardedHashTable` with a time to live."""

from __future__ import annotations

import contextlib

import numpy as np

from .keys import to_host
from .sharded_table import owner_of


def _parts(table, keys):
    """``(shard table, device context, positions)`` of ``keys`` per local
    shard of a `ShardedHashTable`, or the table itself."""
    if getattr(table, "local_shards", None) is None:
        return [(table, contextlib.nullcontext(), slice(None))]
    owner = owner_of(keys, table.num_shards)
    return [(table.shard(d), table.on_device(d), owner == d) for d in table.local]


def keys_last_seen(table, keys):
    """Last-seen step of each int64 key (NumPy) in a `HashTable` or
    `ShardedHashTable` with a time to live; -1 where absent (or owned by
    another process's shard)."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    out = np.full(keys.shape, -1, np.int64)
    for t, on_device, at in _parts(table, keys):
        with on_device, t._lock:
            impl = t._impl
            rows = impl.find(t._convert(keys[at], "keys")[0])
            seen = impl.xp.where(rows >= 0, impl.ttl.last_seen[rows], -1)
            out[at] = to_host(seen)
    return out


def set_keys_last_seen(table, keys, steps):
    """Sets the last-seen steps of the live ``keys`` (NumPy int64; steps
    below 0 leave a key as it is)."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    known = steps >= 0
    keys, steps = keys[known], steps[known]
    for t, on_device, at in _parts(table, keys):
        with on_device, t._lock:
            impl = t._impl
            rows = impl.find(t._convert(keys[at], "keys")[0])
            impl.ttl.load(rows, impl.xp.asarray(steps[at]))
