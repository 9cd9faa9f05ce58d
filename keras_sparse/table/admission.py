"""Bounded-memory admission counter (count-min sketch) shared by both tables.

A count-min sketch keeps ``depth`` rows of ``width`` uint32 counters.  Each key
increments one counter per row (chosen by an independent salted hash) and its
estimate is the minimum over rows.  Collisions can only add to a counter, so
the estimate never under-counts: a key may be admitted *early* (with
probability roughly ``(1 - exp(-depth * distinct / width)) ** depth`` per key
when the sketch is crowded), never late.  Memory is ``4 * depth * width``
bytes, independent of how many distinct keys stream through.
"""

from __future__ import annotations

import numpy as np

from .keys import hash_keys
from .keys import seed_word

DEFAULT_DEPTH = 4
MIN_WIDTH = 1 << 10
MAX_WIDTH = 1 << 22  # 4 rows x 4M x 4 B = 64 MiB at most


def default_width(capacity: int) -> int:
    """Power of two near the table capacity, clamped to [1Ki, 4Mi] counters."""
    width = MIN_WIDTH
    while width < capacity and width < MAX_WIDTH:
        width <<= 1
    return width


class CountMinSketch:
    """Count-min sketch over int64 keys; ``xp`` is NumPy or CuPy."""

    def __init__(
        self, width: int, depth: int = DEFAULT_DEPTH, seed: int = 0, xp=np, add_at=None
    ):
        if width <= 0 or width & (width - 1):
            raise ValueError(
                f"sketch width must be a positive power of two, got {width}"
            )
        self.width, self.depth, self.xp = int(width), int(depth), xp
        self.seed = int(seed)
        self._shift = np.uint64(64 - (self.width.bit_length() - 1))
        # Row salts differ from the table's bucket salt so sketch collisions are
        # independent of bucket collisions.
        self._salts = [
            seed_word(seed * 1000003 + 7919 * (r + 1)) for r in range(self.depth)
        ]
        self._add_at = add_at or _numpy_add_at
        self.counts = xp.zeros((self.depth, self.width), dtype=xp.uint32)

    def _cells(self, keys):
        flat = []
        for r, salt in enumerate(self._salts):
            col = (hash_keys(keys, salt, self.xp) >> self._shift).astype(self.xp.int64)
            flat.append(col + r * self.width)
        return flat

    def add(self, keys, counts):
        """Add ``counts`` for unique int64 ``keys``; return the new estimates."""
        table = self.counts.reshape(-1)
        cells = self._cells(keys)
        inc = counts.astype(self.xp.uint32)
        for c in cells:
            self._add_at(table, c, inc)
        est = table[cells[0]]
        for c in cells[1:]:
            est = self.xp.minimum(est, table[c])
        return est.astype(self.xp.int64)

    def subtract(self, keys, counts, out=None):
        """Exactly undo a previous ``add`` (used when a call must leave no
        trace); from ``out`` (a copy of the counters) when given."""
        table = (self.counts if out is None else out).reshape(-1)
        neg = (-counts.astype(self.xp.int64)).astype(self.xp.uint32)  # wraps mod 2**32
        for c in self._cells(keys):
            self._add_at(table, c, neg)

    def clear(self):
        self.counts.fill(0)

    def state(self):
        """The counters as a NumPy ``[depth, width]`` uint32 array (a copy)."""
        counts = self.counts
        return counts.get() if hasattr(counts, "get") else np.array(counts)

    def load_state(self, counts, seed):
        """Restores counters saved by `state`, possibly from another width.

        A key's cell in width ``w`` is the top ``log2(w)`` bits of its hash, so
        halving the width merges cell pairs ``(2i, 2i + 1)`` into ``i`` and
        doubling it splits cell ``i`` into ``2i`` and ``2i + 1``. Summing on
        merge and copying on split keep every estimate an upper bound of the
        true count: a key is still never admitted late. The depth and the
        seed must match (they fix the row hashes); otherwise ValueError.
        """
        if int(seed) != self.seed:
            raise ValueError(
                f"sketch state was made with seed {seed}; this sketch uses "
                f"{self.seed} (other hash functions)"
            )
        counts = np.asarray(counts, dtype=np.uint64)
        if counts.ndim != 2 or counts.shape[0] != self.depth:
            raise ValueError(
                f"sketch state has shape {counts.shape}; expected ({self.depth}, width)"
            )
        width = counts.shape[1]
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch state width {width} is not a power of two")
        while width > self.width:
            counts = counts[:, 0::2] + counts[:, 1::2]
            width //= 2
        while width < self.width:
            counts = np.repeat(counts, 2, axis=1)
            width *= 2
        counts = np.minimum(counts, np.iinfo(np.uint32).max).astype(np.uint32)
        self.counts[...] = self.xp.asarray(counts)


def _numpy_add_at(arr, idx, val):
    np.add.at(arr, idx, val)
