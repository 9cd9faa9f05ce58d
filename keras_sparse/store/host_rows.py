"""Rows of every field in host memory, in fixed-size blocks.

The first block grows by doubling up to ``block_rows``; after that the
store grows one block at a time, so a store of 1e8 rows never holds a
second copy of its rows while growing (a doubled array would need 3x for
the copy). Reads and writes group slots by block: one NumPy gather or
scatter per block touched, however many rows.
"""

from __future__ import annotations

import numpy as np

from .row_copy import put_rows
from .row_copy import take_rows

#: Bytes per block of one field (rounded down to a power of two of rows).
BLOCK_BYTES = 64 << 20
#: The fewest rows per block (narrow fields still get big blocks).
MIN_BLOCK_ROWS = 1024


class HostRows:
    """``fields``' rows for slots ``[0, capacity)``."""

    def __init__(self, fields, capacity: int = 1024, fixed: bool = False):
        self.fields = fields
        capacity = max(1, int(capacity))
        if fixed:  # a fixed vocabulary: one block of exactly its rows
            self.block_rows = 1 << max(0, (capacity - 1).bit_length())
        else:
            widest = max(f.row_bytes for f in fields)
            rows = max(MIN_BLOCK_ROWS, BLOCK_BYTES // widest)
            self.block_rows = 1 << (rows.bit_length() - 1)
            capacity = min(capacity, self.block_rows)
        self._shift = self.block_rows.bit_length() - 1
        self.blocks = {f.name: [np.zeros((capacity, f.width), f.dtype)] for f in fields}
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for blocks in self.blocks.values() for b in blocks)

    def reserve(self, rows: int):
        """Room for slots ``[0, rows)``."""
        if rows <= self.capacity:
            return
        first = next(iter(self.blocks.values()))[0].shape[0]
        if first < self.block_rows:  # grow the first block by doubling
            size = min(self.block_rows, max(rows, 2 * first))
            for f in self.fields:
                old = self.blocks[f.name][0]
                new = np.zeros((size, f.width), f.dtype)
                new[:first] = old
                self.blocks[f.name][0] = new
            self.capacity = size
        while self.capacity < rows:
            for f in self.fields:
                self.blocks[f.name].append(
                    np.zeros((self.block_rows, f.width), f.dtype)
                )
            self.capacity += self.block_rows

    def _groups(self, slots):
        """Per block touched: (block, positions in ``slots``, rows in block)."""
        nblocks = len(next(iter(self.blocks.values())))
        if nblocks == 1:
            return [(0, slice(None), slots)]
        b = slots >> self._shift
        b = b.astype(np.uint16 if nblocks <= 1 << 16 else np.int64)
        order = np.argsort(b, kind="stable")  # a radix sort for uint16
        ends = np.cumsum(np.bincount(b, minlength=nblocks))
        off = slots & (self.block_rows - 1)
        out, start = [], 0
        for i, end in enumerate(ends.tolist()):
            if end > start:
                sel = order[start:end]
                out.append((i, sel, off[sel]))
            start = end
        return out

    def will_read(self, first: int, end: int):
        """Nothing to prepare: the rows are in memory."""

    def row_arrays(self):
        """``{field: array}`` whose row ``i`` is slot ``i``, where each field
        is one block; else None."""
        if any(len(blocks) != 1 for blocks in self.blocks.values()):
            return None
        return {name: blocks[0] for name, blocks in self.blocks.items()}

    def gather(self, slots, names=None):
        """``{field: rows of slots}``, of the fields ``names`` (default all)."""
        groups = self._groups(slots)
        out = {}
        for f in self.fields:
            if names is not None and f.name not in names:
                continue
            blocks = self.blocks[f.name]
            if groups and isinstance(groups[0][1], slice):
                out[f.name] = take_rows(blocks[0], slots)
                continue
            rows = np.empty((slots.size, f.width), f.dtype)
            for i, sel, off in groups:
                rows[sel] = take_rows(blocks[i], off)
            out[f.name] = rows
        return out

    def scatter(self, slots, rows):
        groups = self._groups(slots)
        for f in self.fields:
            blocks, values = self.blocks[f.name], rows[f.name]
            for i, sel, off in groups:
                part = values if isinstance(sel, slice) else take_rows(values, sel)
                put_rows(blocks[i], off, part)

    def fill(self, start: int, values):
        """Rows ``[start, start + len)`` (a fixed store's initializer)."""
        for f in self.fields:
            v = values[f.name]
            self.blocks[f.name][0][start : start + v.shape[0]] = v

    def zero_all(self):
        # New zeroed arrays: the OS maps their pages on first touch, where
        # filling the old ones would write every page.
        self.blocks = {
            f.name: [np.zeros(b.shape, b.dtype) for b in self.blocks[f.name]]
            for f in self.fields
        }

    def shrink(self, capacity: int):
        """Back to one zeroed block of ``capacity`` rows (a cleared store)."""
        capacity = max(1, min(int(capacity), self.block_rows))
        self.blocks = {
            f.name: [np.zeros((capacity, f.width), f.dtype)] for f in self.fields
        }
        self.capacity = capacity

    def flush(self):
        pass

    def close(self):
        self.blocks = {}
