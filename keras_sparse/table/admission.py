"""Exact admission counts: sightings of the keys not admitted yet.

A table with ``admit_after > 1`` keeps every absent key it has seen, with
its number of sightings, in a second hash table of the same kind (the
*pending* table: LFU eviction, its score is the count). A key is admitted
at exactly its ``admit_after``-th sighting and then leaves the pending
table, so an admitted key costs nothing here (an evicted key counts its
sightings from zero again).

Memory cap: the pending table has as many slots as the main table (its
capacity; per shard for a sharded table, so the same in total), about 17
bytes per slot (key, count, fingerprint). While the pending keys fit,
counts are exact, so admission depends only on each key's own sightings:
identical for any shard count, process count or batch split. Beyond the
cap the least-counted pending keys are forgotten (LFU), and a key whose two
pending buckets are full of this call's keys is not counted in that call.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .keys import to_host

# Salts the pending table's buckets apart from the main table's.
_SEED_OFFSET = 0x9E3779B9


class CountRecord(NamedTuple):
    """What one call changed in the pending counts (for undo)."""

    keys: object  # the call's distinct absent keys
    before: object  # their counts before the call (0: not pending)
    evicted_keys: object  # pending keys forgotten to make room
    evicted_counts: object


class ExactCounts:
    """Pending keys with exact sighting counts; ``table_cls`` is the main
    table's class (`NumpyTable` or `CupyTable`), which holds them."""

    def __init__(self, table_cls, num_buckets, bucket_size, seed):
        self.seed = int(seed)
        self.table = table_cls(
            num_buckets, bucket_size, "lfu", 1, (self.seed + _SEED_OFFSET) % 2**63
        )
        self.xp = self.table.xp

    @property
    def capacity(self):
        """Most pending keys kept (the memory cap)."""
        return self.table.capacity

    def __len__(self):
        return self.table.size

    def peek(self, keys, counts):
        """``(totals, before)``: counts of distinct ``keys`` after adding
        ``counts``, and before (0 for keys not pending); nothing changes."""
        t = self.table
        rows = t.find(keys)
        held = rows >= 0
        before = self.xp.where(held, t.score[self.xp.where(held, rows, 0)], 0)
        return before + counts, before

    def commit(self, keys, counts, before, admitted, record=False):
        """Adds ``counts`` of the keys not ``admitted`` and forgets the
        admitted ones; returns a `CountRecord` when ``record``."""
        xp, t = self.xp, self.table
        gone = keys[admitted & (before > 0)]
        if gone.shape[0]:
            t.erase(gone)
        stay = ~admitted
        sightings = xp.repeat(keys[stay], counts[stay])
        log = [] if record else None
        if sightings.shape[0]:
            # LFU scores count duplicates: each key's score grows by its count.
            t.lookup_or_insert_fresh(sightings, undo=log)
        if not record:
            return None
        if log:
            ev_keys, ev_counts = log[0].evicted_keys, log[0].evicted_scores
        else:
            ev_keys = ev_counts = xp.zeros(0, dtype=xp.int64)
        return CountRecord(keys.copy(), before, ev_keys, ev_counts)

    def clear(self):
        self.table.clear()

    def state(self):
        """``(keys, counts)`` of the pending keys as NumPy int64 arrays
        (ascending keys)."""
        keys, _, scores = self.table.export()
        keys, scores = to_host(keys), to_host(scores)
        order = np.argsort(keys, kind="stable")
        return keys[order], scores[order]

    def load_state(self, keys, counts):
        """Replaces the pending keys by ``(keys, counts)`` (distinct keys);
        returns how many were kept: the most-counted up to the cap, zero
        counts dropped."""
        keys = np.asarray(keys, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        keep = counts > 0
        keys, counts = keys[keep], counts[keep]
        order = np.argsort(-counts, kind="stable")[: self.capacity]
        keys, counts = keys[order], counts[order]
        t, xp = self.table, self.xp
        t.clear()
        if not keys.shape[0]:
            return 0
        res = t.import_(xp.asarray(keys), scores=xp.asarray(counts))
        return int(to_host(res.rows >= 0).sum())


def counts_before(state, records):
    """Pending ``(keys, counts)`` (NumPy) before the calls that wrote
    `CountRecord` ``records`` (call order), from ``state`` after them."""
    keys, counts = state
    for r in reversed(records):
        if r is None:
            continue
        uk, before = to_host(r.keys), to_host(r.before)
        evk, evc = to_host(r.evicted_keys), to_host(r.evicted_counts)
        drop = np.isin(keys, uk) | np.isin(keys, evk)
        back = before > 0
        keys = np.concatenate([keys[~drop], uk[back], evk])
        counts = np.concatenate([counts[~drop], before[back], evc])
    order = np.argsort(keys, kind="stable")
    return keys[order], counts[order]
