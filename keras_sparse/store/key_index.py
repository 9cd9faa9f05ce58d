"""int64 key -> storage slot: a vectorized open-addressing hash index.

Linear probing over a power-of-two table of slot numbers (-1 empty, -2 a
removed entry). Keys are not kept in the table but per slot (``keys``), so
the table is 4 bytes per position while slots fit int32: with the load
kept between 0.25 and 0.6, the table costs 7-16 bytes per key, plus 8-16
for the key itself (the slot arrays grow by doubling); about 17 in all
for 1e6 keys. Every operation probes all keys of a call together, one
NumPy step per probe distance (a few dozen at most), never a Python loop
per key. Any int64 is a key: emptiness is a table value, not a key value.
"""

from __future__ import annotations

import numpy as np

from keras_sparse.table.keys import hash_keys
from keras_sparse.table.keys import seed_word

EMPTY = -1
REMOVED = -2
_SALT = seed_word(0x5EED)
_MAX_LOAD = 0.6  # live + removed entries, of the table size
_TARGET_LOAD = 0.5  # after a rebuild, at most this
_INT32_SLOTS = 2**31 - 1


def _table_size(entries: int) -> int:
    need = max(16, int(np.ceil(entries / _TARGET_LOAD)))
    return 1 << (need - 1).bit_length()


class KeyIndex:
    """Keys of slots ``[0, slot_capacity)`` and the hash table over them."""

    def __init__(self, slot_capacity: int = 1024):
        slot_capacity = max(1, int(slot_capacity))
        self.keys = np.zeros(slot_capacity, np.int64)
        self._set_table(np.full(_table_size(slot_capacity), EMPTY, np.int32))
        self.count = 0
        self.removed = 0

    @classmethod
    def from_arrays(cls, table, keys, count: int, removed: int):
        """An index over saved arrays (see `arrays`); they are kept, not
        copied."""
        self = cls.__new__(cls)
        self.keys = keys
        self._set_table(table)
        self.count = int(count)
        self.removed = int(removed)
        return self

    def arrays(self):
        return {"table": self.table, "keys": self.keys}

    def _set_table(self, table):
        size = table.size
        if size & (size - 1) or size < 2:
            raise ValueError(f"KeyIndex: table size must be a power of two, got {size}")
        self.table = table
        self._shift = np.uint64(64 - (size.bit_length() - 1))
        self._mask = size - 1

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.keys.nbytes

    def _home(self, keys):
        # High bits of the splitmix64 hash: the best mixed ones.
        return (hash_keys(keys, _SALT) >> self._shift).view(np.int64)

    def find(self, keys, positions: bool = False):
        """``(slots, table positions or None)`` of ``keys``: -1 where a key
        is absent (positions only when asked)."""
        n = keys.size
        if n == 0 or self.count == 0:
            missing = np.full(n, -1, np.int64)
            return missing, (missing.copy() if positions else None)
        table, stored, mask = self.table, self.keys, self._mask
        # The first probe covers every key: whole-array steps, no index.
        p = self._home(keys)
        v = table[p].astype(np.int64)
        used = v >= 0
        hit = used & (stored[np.where(used, v, 0)] == keys)
        slots = np.where(hit, v, -1)
        where = np.where(hit, p, -1) if positions else None
        idx = np.flatnonzero((v != EMPTY) & ~hit)
        k, p = keys[idx], (p[idx] + 1) & mask
        while idx.size:  # the keys probing further: fewer each round
            v = table[p].astype(np.int64)
            used = v >= 0
            hit = used & (stored[np.where(used, v, 0)] == k)
            if hit.any():
                slots[idx[hit]] = v[hit]
                if positions:
                    where[idx[hit]] = p[hit]
            go = (v != EMPTY) & ~hit
            idx, k, p = idx[go], k[go], (p[go] + 1) & mask
        return slots, where

    def reserve_slots(self, slot_capacity: int):
        """Room for slots ``[0, slot_capacity)`` (grows by doubling)."""
        old = self.keys.size
        if slot_capacity > old:
            keys = np.zeros(max(slot_capacity, 2 * old), np.int64)
            keys[:old] = self.keys
            self.keys = keys

    def insert(self, keys, slots):
        """Adds ``keys`` (unique, absent) at ``slots`` (reserved)."""
        if keys.size == 0:
            return
        self.keys[slots] = keys
        if slots.max() >= _INT32_SLOTS and self.table.dtype == np.int32:
            self.table = self.table.astype(np.int64)
        if self.count + self.removed + keys.size > _MAX_LOAD * self.table.size:
            self._rebuild(self.count + keys.size)
        self._place(keys, slots.astype(self.table.dtype))
        self.count += keys.size

    def remove(self, positions):
        """Removes the entries at ``positions`` (from `find`, distinct)."""
        self.table[positions] = REMOVED
        self.count -= positions.size
        self.removed += positions.size

    def _rebuild(self, entries: int):
        """A new table for ``entries`` keys, without removed entries."""
        old = self.table
        live = old[old >= 0]
        self._set_table(np.full(_table_size(entries), EMPTY, old.dtype))
        self.removed = 0
        self._place(self.keys[live], live)

    def _place(self, keys, slots):
        """Linear probing from each key's home to the first free position;
        keys racing for one position: one wins, the others probe on."""
        table, mask = self.table, self._mask
        idx = np.arange(keys.size)
        p = self._home(keys)
        while idx.size:
            v = table[p]
            free = np.flatnonzero(v < 0)
            placed = np.zeros(idx.size, bool)
            if free.size:
                fp, mine = p[free], slots[idx[free]]
                table[fp] = mine
                won = table[fp] == mine
                self.removed -= int(np.count_nonzero(won & (v[free] == REMOVED)))
                placed[free[won]] = True
            keep = ~placed
            idx, p = idx[keep], (p[keep] + 1) & mask
