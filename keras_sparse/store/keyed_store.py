"""A row store keyed by any int64: a `KeyIndex` over storage slots, and
the rows of those slots (in host memory or memory-mapped files)."""

from __future__ import annotations

import numpy as np

from .fields import check_keys
from .fields import check_rows
from .fields import distinct
from .key_index import KeyIndex
from .slot_stack import SlotStack
from .store_base import StoreBase


class KeyedStore(StoreBase):
    """Shared by `HostStore` and `DiskStore`: the rows backend (``_rows``)
    is theirs. Freed slots are reused; with ``hold_freed`` (disk) only
    after the next `flush`, so a slot the saved index names never takes
    another key's rows before the index on disk says so."""

    _hold_freed = False

    def _setup(self, fields, rows, index, live, free, slots):
        self._setup_common(fields, rows)
        self._index = index
        self._live = live  # bool per slot: holds a key
        self._free = SlotStack(free)  # reusable slots
        self._held = SlotStack()  # freed since the last flush (disk)
        self._slots = int(slots)  # slots ever used: [0, _slots)

    # --- state -------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._index.count

    @property
    def nbytes(self) -> int:
        row_bytes = sum(f.row_bytes for f in self._fields)
        index = self._index.nbytes + self._live.nbytes
        return self.size * row_bytes + index + self._free.nbytes + self._held.nbytes

    # --- operations ----------------------------------------------------------
    def read(self, keys):
        return self.read_fields(keys)

    def read_fields(self, keys, names=None):
        """`read`, of the fields ``names`` only (default all): the others
        are not gathered."""
        self._check_open()
        keys = check_keys(keys, f"{type(self).__name__}.read")
        slots, _ = self._index.find(keys)
        found = slots >= 0
        hits = int(np.count_nonzero(found))
        self._counts["reads"] += keys.size
        self._counts["hits"] += hits
        self._counts["misses"] += keys.size - hits
        if hits == keys.size:
            return found, self._rows.gather(slots, names)
        # Missing keys read slot 0 (always allocated), then zeros: one
        # gather per field, no partial copies.
        got = self._rows.gather(np.where(found, slots, 0), names)
        for r in got.values():
            r[~found] = 0
        return found, got

    def contains(self, keys):
        self._check_open()
        keys = check_keys(keys, f"{type(self).__name__}.contains")
        return self._index.find(keys)[0] >= 0

    def write(self, keys, rows):
        self._check_open()
        who = f"{type(self).__name__}.write"
        keys = check_keys(keys, who, unique=True)
        rows = check_rows(self._fields, rows, keys.size, who)
        slots, _ = self._index.find(keys)
        new = slots < 0
        if new.any():
            slots[new] = self._take_slots(int(np.count_nonzero(new)))
            self._index.insert(keys[new], slots[new])
            self._live[slots[new]] = True
        self._rows.scatter(slots, rows)
        self._counts["writes"] += keys.size
        self._version += 1

    def _take_slots(self, m: int):
        end = self._slots + m - min(m, self._free.size)
        # Room first: a failed growth (memory, disk) leaves the store as it was.
        if end > self._live.size:
            live = np.zeros(max(end, 2 * self._live.size), bool)
            live[: self._live.size] = self._live
            self._live = live
        self._index.reserve_slots(end)
        self._rows.reserve(end)
        taken = self._free.pop(m)
        fresh = np.arange(self._slots, end, dtype=np.int64)
        self._slots = end
        return np.concatenate([taken, fresh])

    def erase(self, keys) -> int:
        self._check_open()
        keys = check_keys(keys, f"{type(self).__name__}.erase")
        _, where = self._index.find(keys, positions=True)
        where = distinct(where[where >= 0])  # a key given twice: once
        slots = self._index.table[where].astype(np.int64)
        self._index.remove(where)
        self._live[slots] = False
        (self._held if self._hold_freed else self._free).push(slots)
        self._counts["erases"] += slots.size
        self._version += 1
        return int(slots.size)

    def _chunks(self, step, version):
        start = 0
        while start < self._slots:
            self._check_unchanged(version)
            end = min(start + step, self._slots)
            slots = start + np.flatnonzero(self._live[start:end])
            start = end
            if slots.size:
                self._rows.will_read(int(slots[0]), int(slots[-1]) + 1)
                yield self._index.keys[slots].copy(), self._rows.gather(slots)

    def clear(self):
        self._check_open()
        # Back to the initial sizes: a cleared store gives its memory back.
        self._index = KeyIndex(self._initial_capacity)
        self._live = np.zeros(self._initial_capacity, bool)
        self._free, self._held = SlotStack(), SlotStack()
        self._slots = 0
        self._rows.shrink(self._initial_capacity)
        self._version += 1

    def close(self):
        if not self._closed:
            super().close()
            self._index = self._live = None
