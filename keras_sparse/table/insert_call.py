"""``lookup_or_insert`` of the GPU table in one kernel launch (``ks_insert_call``).

The multi-launch path (``ArrayTable._insert_call`` on CuPy arrays) pays about
ten host syncs and 70-150 CuPy operations per call, which dominate the time
of embedding-sized batches. ``ks_insert_call`` (``kernels/insert_call.cu``)
runs the whole call in one block: probe, dedup of the absent keys, admission,
placement and eviction rounds, touch and counts; the host then reads one
8-word summary (status and output sizes) and slices the batch-sized outputs.
Rows, new rows, evicted pairs, counters and stored state equal the CPU
twin's call by call (the conformance suite runs on it).

Batches of more than ``MAX_KEYS`` keys (one block would leave the GPU idle)
or more keys than the table has rows (the distinct-hit check needs the
multi-launch path) take the multi-launch path.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .cuda_modules import module
from .numpy_table import InsertResult
from .numpy_table import TableFullError

MAX_KEYS = 1 << 16
THREADS = 512  # KS_FT in kernels/insert_call.cu
_WORDS_PER_KEY = 20  # workspace int64 arrays of the batch size (see the kernel)
_SET_ARRAYS = 5  # dedup-set arrays of H words
_EVICTION_CODE = {None: 0, "lru": 1, "lfu": 2}
_NO_BID = np.iinfo(np.int64).max
# Summary words (KS_S_* in the kernel).
_STATUS, _NEW, _PLACED, _EVICTED, _MISSES, _REJECTED, _OVERFLOWS, _FILLED = range(8)


class FusedInsert:
    """Per-table device state of the one-launch call (workspace, marks)."""

    def __init__(self, table):
        self.table = table
        self.workspace = cp.zeros(0, dtype=cp.int64)
        self.stamp = None  # uint32 per row: protected in the call with that stamp
        self.call_stamp = 0
        self.dummy_u32 = cp.zeros(1, dtype=cp.uint32)
        self.dummy_u64 = cp.zeros(1, dtype=cp.uint64)
        self.sketch_salts = None

    @classmethod
    def of(cls, table):
        fused = table.__dict__.get("_fused_insert")
        if fused is None:
            fused = table._fused_insert = cls(table)
        return fused

    def eligible(self, n):
        return 0 < n <= MAX_KEYS and n <= self.table.capacity

    def call(self, k, step):
        """``(InsertResult, fresh)`` of one call, or None when not eligible."""
        t = self.table
        n = int(k.shape[0])
        if not self.eligible(n):
            return None
        clock0 = t.clock
        step = t._next_step(step)
        # As ArrayTable._insert_call: LRU slots touched in this call hold
        # score == step exactly when no stored score is above the clock.
        score_prot = (
            t.eviction == "lru"
            and step > clock0
            and not t.__dict__.get("_score_above_clock", False)
        )
        use_stamp = not score_prot and t.eviction is not None
        stamp = self._next_stamp() if use_stamp else self.dummy_u32
        if getattr(t, "_bids", None) is None:
            t._bids = cp.full(t.num_buckets, _NO_BID, dtype=cp.int64)
        set_size = 1 << max(2 * n - 1, 1).bit_length()
        words = _WORDS_PER_KEY * n + _SET_ARRAYS * set_size
        if self.workspace.shape[0] < words:
            self.workspace = cp.empty(words, dtype=cp.int64)
        sketch = t.sketch
        if sketch is not None and self.sketch_salts is None:
            self.sketch_salts = cp.asarray(np.asarray(sketch._salts, dtype=np.uint64))
        rows = cp.empty(n, dtype=cp.int64)
        fresh = cp.empty(n, dtype=cp.bool_)
        new_rows = cp.empty(n, dtype=cp.int64)
        ev_keys = cp.empty(n, dtype=cp.int64)
        ev_rows = cp.empty(n, dtype=cp.int64)
        summary = cp.zeros(8, dtype=cp.int64)
        module("insert_call.cu").get_function("ks_insert_call")(
            (1,),
            (THREADS,),
            (
                cp.ascontiguousarray(k, dtype=cp.int64),
                np.int64(n),
                np.uint64(t.salt),
                np.uint64(t.num_buckets),
                np.int32(t.bucket_size),
                np.int64(t.capacity),
                np.int64(t.size),
                np.int32(_EVICTION_CODE[t.eviction]),
                np.int64(step),
                np.int32(score_prot),
                np.int64(t.admit_after),
                t.keys,
                t.digest,
                t.score,
                t.load,
                t.holey,
                t.bucket_sentinel,
                stamp,
                np.uint32(self.call_stamp),
                t._bids,
                np.int32(sketch is not None),
                self.dummy_u32 if sketch is None else sketch.counts,
                np.int32(0 if sketch is None else sketch.depth),
                np.int64(0 if sketch is None else sketch.width),
                np.int32(0 if sketch is None else int(sketch._shift)),
                self.dummy_u64 if sketch is None else self.sketch_salts,
                self.workspace,
                np.int64(set_size),
                rows,
                fresh,
                new_rows,
                ev_keys,
                ev_rows,
                summary,
            ),
        )
        s = [int(v) for v in summary.get()]  # the call's one host sync
        if s[_STATUS] == 1:
            raise TableFullError(
                f"hash table full: capacity {t.capacity}, size {t.size}, "
                f"{s[_NEW]} new keys and eviction=None"
            )
        if s[_STATUS] == 2:
            raise TableFullError(
                "hash table full: both candidate buckets of a key are full "
                f"(capacity {t.capacity}, size {t.size}) and eviction=None"
            )
        t.size += s[_FILLED]
        c = t.counters
        c["hits"] += n - s[_MISSES]
        c["misses"] += s[_MISSES]
        c["rejected_admissions"] += s[_REJECTED]
        c["inserts"] += s[_PLACED]
        c["evictions"] += s[_EVICTED]
        c["overflows"] += s[_OVERFLOWS]
        result = InsertResult(
            rows, new_rows[: s[_PLACED]], ev_keys[: s[_EVICTED]], ev_rows[: s[_EVICTED]]
        )
        return result, fresh

    def _next_stamp(self):
        """The protection marks for a new call (no row carries its stamp)."""
        if self.stamp is None or self.call_stamp == np.iinfo(np.uint32).max:
            self.stamp = cp.zeros(self.table.capacity, dtype=cp.uint32)
            self.call_stamp = 0
        self.call_stamp += 1
        return self.stamp
