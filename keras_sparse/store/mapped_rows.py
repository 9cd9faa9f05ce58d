"""Rows of every field in a memory-mapped file of its own (``<name>.rows``,
row-major, no header: the manifest says the fields and row count).

Reads and writes are NumPy gathers and scatters on the maps: the OS page
cache keeps the hot pages in memory and writes dirty ones back. A file
grows by doubling (at least `GROW_BYTES` at a time) and is extended
sparsely, so unwritten rows cost no disk space and read as zeros.

The maps are advised random access: a training step reads scattered rows,
and the kernel's default readahead would pull up to its readahead window
(MiBs) around each one (on a 36 GB store, about 1 GB/s of disk reads for
about 350 KB of rows a step). Reads of a whole range (chunks for saves and
exports) ask for the range first (`will_read`), so they still stream.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from .row_copy import put_rows
from .row_copy import take_rows

#: The least a row file grows by at once.
GROW_BYTES = 64 << 20


def row_file(folder, field) -> str:
    return os.path.join(folder, f"{field.name}.rows")


class MappedRows:
    """``fields``' rows for slots ``[0, capacity)``, one file per field."""

    def __init__(self, folder, fields, capacity: int, create: bool):
        self.folder = folder
        self.fields = fields
        self.capacity = max(1, int(capacity))
        self.maps = {}
        for f in fields:
            path = row_file(folder, f)
            if create:
                with open(path, "wb") as fh:
                    fh.truncate(self.capacity * f.row_bytes)
            self.maps[f.name] = self._map(f)

    def _map(self, f):
        rows = np.memmap(
            row_file(self.folder, f), f.dtype, "r+", shape=(self.capacity, f.width)
        )
        _advise(rows, getattr(mmap, "MADV_RANDOM", None))
        return rows

    def will_read(self, first: int, end: int):
        """Rows ``[first, end)`` are about to be read in order: start
        reading them from disk now (the maps are advised random)."""
        for f in self.fields:
            _advise(
                self.maps[f.name],
                getattr(mmap, "MADV_WILLNEED", None),
                first * f.row_bytes,
                (end - first) * f.row_bytes,
            )

    def row_arrays(self):
        """``{field: map}``: row ``i`` is slot ``i``."""
        return dict(self.maps)

    @property
    def nbytes(self) -> int:
        return sum(self.capacity * f.row_bytes for f in self.fields)

    def file_bytes(self) -> int:
        return sum(os.path.getsize(row_file(self.folder, f)) for f in self.fields)

    def reserve(self, rows: int):
        if rows <= self.capacity:
            return
        step = max(GROW_BYTES // min(f.row_bytes for f in self.fields), 1)
        self._resize(max(rows, 2 * self.capacity, self.capacity + step))

    def _resize(self, capacity: int):
        for m in self.maps.values():
            m.flush()
        self.maps = {}  # unmaps (the maps are never handed out)
        for f in self.fields:
            os.truncate(row_file(self.folder, f), capacity * f.row_bytes)
        self.capacity = capacity
        self.maps = {f.name: self._map(f) for f in self.fields}

    def gather(self, slots, names=None):
        """``{field: rows of slots}``, of the fields ``names`` (default all)."""
        fields = self.fields
        if names is not None:
            fields = [f for f in fields if f.name in names]
        return {f.name: take_rows(self.maps[f.name], slots) for f in fields}

    def scatter(self, slots, rows):
        for f in self.fields:
            put_rows(self.maps[f.name], slots, rows[f.name])

    def fill(self, start: int, values):
        for f in self.fields:
            v = values[f.name]
            self.maps[f.name][start : start + v.shape[0]] = v

    def zero_all(self):
        # Cutting a file to nothing and extending it again zeroes it and
        # gives its disk space back.
        self._resize_zeroed(self.capacity)

    def shrink(self, capacity: int):
        self._resize_zeroed(max(1, int(capacity)))

    def _resize_zeroed(self, capacity):
        self.maps = {}
        for f in self.fields:
            os.truncate(row_file(self.folder, f), 0)
        self.capacity = 1
        self._resize(capacity)

    def flush(self):
        """Dirty pages to disk, and the files' sizes with them."""
        for f in self.fields:
            self.maps[f.name].flush()
            fd = os.open(row_file(self.folder, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self):
        for m in self.maps.values():
            m.flush()
        self.maps = {}


def _advise(rows, advice, start=0, length=None):
    """``madvise`` on a row map's pages (from byte ``start``, rounded down to
    a page); nothing where the platform lacks the advice."""
    mapping = getattr(rows, "_mmap", None)
    if advice is None or mapping is None or not hasattr(mapping, "madvise"):
        return
    size = len(mapping)
    first = start - start % mmap.PAGESIZE
    length = size - first if length is None else start + length - first
    length = min(length, size - first)
    if length > 0:
        mapping.madvise(advice, first, length)
