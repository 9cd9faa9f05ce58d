"""A growable stack of int64 slots (the free slots of a keyed store):
push and pop whole arrays in amortized O(their size), not O(stack)."""

from __future__ import annotations

import numpy as np


class SlotStack:
    def __init__(self, values=None):
        values = np.zeros(0, np.int64) if values is None else values
        self._data = np.array(values, np.int64)
        self.size = self._data.size

    def push(self, slots):
        end = self.size + slots.size
        if end > self._data.size:
            data = np.zeros(max(end, 2 * self._data.size), np.int64)
            data[: self.size] = self._data[: self.size]
            self._data = data
        self._data[self.size : end] = slots
        self.size = end

    def pop(self, m: int):
        """Up to ``m`` slots, the last pushed first."""
        m = min(m, self.size)
        self.size -= m
        return self._data[self.size : self.size + m].copy()

    def values(self):
        return self._data[: self.size]

    @property
    def nbytes(self) -> int:
        return self._data.nbytes
