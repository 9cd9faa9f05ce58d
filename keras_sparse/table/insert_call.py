"""``lookup_or_insert`` of the GPU table in one kernel launch (``ks_insert_calls``).

The multi-launch path (``ArrayTable._insert_call`` on CuPy arrays) pays about
ten host syncs and 70-150 CuPy operations per call, which dominate the time
of embedding-sized batches. ``ks_insert_calls``
(``keras_sparse/kernels/insert_call.cu``) runs the whole call in one block:
probe, dedup of the absent keys, placement and eviction rounds,
touch and counts. Rows, new rows, evicted
pairs, counters and stored state equal the CPU twin's call by call (the
conformance suite runs on it).

The counters, the size change and a failure accumulate on the device (an
account of 16 words). `FusedInsert.call` (``lookup_or_insert``) reads it
once after the call, to raise at once and to slice the batch-sized outputs;
`FusedInsert.step_rows` (a training step's rows) reads nothing: the account
is read when the host next needs a count (``stats()``, ``size``, any other
table call), so consecutive steps run with no host sync at all.

A launch takes a descriptor of one record per block (`FusedInsert.record`:
the call's table, keys, outputs, workspace and account as pointers and
scalars), so `step_calls.step_rows_many` runs the step calls of several tables (a
model's hash fields) in one launch, one block per table.

Batches of more than ``MAX_KEYS`` keys, where one block would leave the
GPU idle, run the same phases on every block of one cooperative launch
(``ks_insert_grid``: grid-wide barriers and prefix sums, one block per
multiprocessor): still one launch and no host sync per call, at any batch
size, with the same results. Batches of more keys than the table has rows
take the grid launch too, which then also counts the batch's distinct keys
(more than the table's rows fail the call, as on the CPU twin). Tables with
admission (``admit_after > 1``) take the multi-launch path: their exact
counts live in a second table (`keras_sparse.table.admission`) that the
kernel does not read; so does every call on a device without cooperative
launches. `MAX_KEYS` and `GRID_ROUTE` choose the route here; the launches
themselves, the grid's teams and their knobs are `keras_sparse.table.launches`.
"""

from __future__ import annotations

import contextlib
import threading

import cupy as cp
import numpy as np

from .call_results import BatchTooLargeError
from .call_results import InsertResult
from .call_results import TableFullError
from .launches import grid_available
from .launches import launch
from .launches import launch_grid

MAX_KEYS = 1 << 16  # larger calls run on the whole grid (ks_insert_grid)
GRID_ROUTE = True  # False: larger calls take the multi-launch path
DESC_WORDS = 40  # KS_DESC_WORDS: int64 words of one call's record
_WORDS_PER_KEY = 20  # workspace int64 arrays of the batch size (see the kernel)
_SET_ARRAYS = 5  # dedup-set arrays of H words
_EVICTION_CODE = {None: 0, "lru": 1, "lfu": 2}
_NO_BID = np.iinfo(np.int64).max
# Account words (KS_A_* in the kernel).
ACCOUNT = (
    "hits",
    "misses",
    "inserts",
    "evictions",
    "rejected_admissions",
    "overflows",
    "size",
    "status",
    "new_keys",
    "placed",
    "evicted",
)
_A = {name: i for i, name in enumerate(ACCOUNT)}
_COUNTERS = ACCOUNT[:6]


class FusedInsert:
    """Per-table device state of the one-launch call (workspace, marks)."""

    def __init__(self, table):
        self.table = table
        self.workspace = cp.zeros(0, dtype=cp.int64)
        self.stamp = None  # uint32 per row: protected in the call with that stamp
        self.call_stamp = 0
        self.dummy_u32 = cp.zeros(1, dtype=cp.uint32)
        self.dummy_u64 = cp.zeros(1, dtype=cp.uint64)
        self.dummy_i32 = cp.zeros(1, dtype=cp.int32)
        self.step_outputs = cp.empty((4, 0), dtype=cp.int64)
        self.account = cp.zeros(16, dtype=cp.int64)
        self.unread = False  # the account holds calls the host has not read
        # A read (get, then zero) must not interleave with another thread's
        # launch, whose counts the zeroing would drop.
        self.lock = threading.RLock()

    @classmethod
    def of(cls, table):
        fused = table.__dict__.get("_fused_insert")
        if fused is None:
            fused = table._fused_insert = cls(table)
        return fused

    def route(self, n):
        """``"block"`` (one block), ``"grid"`` (every block of a cooperative
        launch: more than `MAX_KEYS` keys, or more keys than the table has
        rows, whose distinct count the grid call checks), or None (the
        multi-launch path) for a call of ``n`` keys."""
        # Exact admission counts live in a second table the kernel does not
        # read: tables with admit_after > 1 take the multi-launch path.
        t = self.table
        if n <= 0 or t.admission is not None:
            return None
        if n <= MAX_KEYS and n <= t.capacity:
            return "block"
        return "grid" if GRID_ROUTE and grid_available() else None

    def eligible(self, n):
        return self.route(n) is not None

    def call(self, k, step):
        """``(InsertResult, fresh)`` of one call, or None when not eligible."""
        n = int(k.shape[0])
        if not self.eligible(n):
            return None
        with self.lock:
            rows, fresh, new_rows, ev_keys, ev_rows = self._launch(k, None, False, step)
            a = self.read()  # the call's one host sync; raises if it failed
        placed, evicted = a[_A["placed"]], a[_A["evicted"]]
        result = InsertResult(
            rows, new_rows[:placed], ev_keys[:evicted], ev_rows[:evicted]
        )
        return result, fresh

    def step_rows(self, k, use, out, step=None):
        """Writes a training step's ``(rows, fresh)`` into ``out`` (flat int32
        and bool device arrays) with no host sync; returns ``out``, or None
        when not eligible (or the table has eviction=None: a full table must
        fail the step itself, not a later read).

        ``use`` (bool, or None for all): positions without a row and
        uncounted (padding). ``fresh`` is True only where a new row first
        appears (one initial vector per new row)."""
        n = int(k.shape[0])
        if self.table.eviction is None or not self.eligible(n):
            return None
        with self.lock:
            self._launch(k, use, True, step, out)
            if n > self.table.capacity:
                # More keys than rows: the call may have failed (too many
                # distinct keys), which must fail this step, not a later read.
                self.read()
        return out

    def read(self):
        """Applies the calls not yet read to the table's size and counters
        (one host sync) and raises the error of a failed one; returns the
        account as read (host ints)."""
        with self.lock:
            if not self.unread:
                return None
            # Steps launch on XLA's stream, which need not wait for (or be
            # waited for by) this thread's stream: settle the whole device
            # around the read and the reset, so no launch is half counted.
            device = cp.cuda.Device()
            device.synchronize()
            a = [int(v) for v in self.account.get()]
            self.account.fill(0)
            device.synchronize()
            self.unread = False
            t = self.table
            t._size += a[_A["size"]]
            for name in _COUNTERS:
                t._counters[name] += a[_A[name]]
        if a[_A["status"]] == 1:
            raise TableFullError(
                f"hash table full: capacity {t.capacity}, size {t._size}, "
                f"{a[_A['new_keys']]} new keys and eviction=None"
            )
        if a[_A["status"]] == 3:
            raise BatchTooLargeError(
                f"batch has {a[_A['new_keys']]} distinct admitted keys but the "
                f"table capacity is {t.capacity}; split the batch or grow the table"
            )
        if a[_A["status"]] == 2:
            raise TableFullError(
                "hash table full: both candidate buckets of a key are full "
                f"(capacity {t.capacity}, size {t._size}) and eviction=None"
            )
        return a

    def _launch(self, k, use, first_only, step, out=None):
        with clocks_kept_on_error([self.table]):
            record, outputs = self.record(k, use, first_only, step, out)
            if self.route(int(k.shape[0])) == "grid":
                launch_grid([record], self)
            else:
                launch([record])
        return outputs

    def record(self, k, use, first_only, step, out=None, workspace=None):
        """``(record, outputs)``: this table's call as a descriptor record of
        ``ks_insert_calls`` (`DESC_WORDS` int64 words) and its output arrays
        ``(rows, fresh, new_rows, ev_keys, ev_rows)``. Advances the table's
        clock: the caller must launch the record, or set the clock back
        when it cannot. The arrays the record
        points at are held until this table's next record, so the launch
        may outlive the caller's references."""
        n = int(k.shape[0])
        if out is None:
            rows = cp.empty(n, dtype=cp.int64)
            fresh = cp.empty(n, dtype=cp.bool_)
            new_rows = cp.empty(n, dtype=cp.int64)
            ev_keys = cp.empty(n, dtype=cp.int64)
            ev_rows = cp.empty(n, dtype=cp.int64)
            rows32 = self.dummy_i32
            outputs = (rows, new_rows, ev_keys, ev_rows)
        else:  # outputs the step does not read: reused buffers
            rows32, fresh = out
            rows, new_rows, ev_keys, ev_rows = self._step_buffers(n)[:, :n]
            outputs = None
        k = cp.ascontiguousarray(k, dtype=cp.int64)
        use_arg = fresh if use is None else cp.ascontiguousarray(use, dtype=cp.bool_)
        record = self.record_at(
            n,
            k.data.ptr,
            use_arg.data.ptr,
            use is not None,
            first_only,
            step,
            rows32.data.ptr,
            fresh.data.ptr,
            out is not None,
            outputs,
            workspace,
        )
        self.held += [k, use_arg, rows32, fresh]
        return record, (rows, fresh, new_rows, ev_keys, ev_rows)

    def record_at(
        self,
        n,
        keys,
        use,
        has_use,
        first_only,
        step,
        rows32,
        fresh,
        step_out,
        out=None,
        workspace=None,
    ):
        """The record of one call on device pointers: ``n`` int64 ``keys``,
        bool ``use`` (read when ``has_use``), int32 ``rows32`` (written when
        ``step_out``) and bool ``fresh``; ``out``: the int64 ``(rows,
        new_rows, ev_keys, ev_rows)`` arrays, or None for the reused step
        buffers. The caller keeps the four pointed-at arrays alive until the
        launch is queued. ``workspace``: the call's scratch (default: this
        table's own), at least `workspace_words` of ``n``. Advances the
        table's clock (see `record`)."""
        t = self.table
        clock0 = t.clock
        step = t._next_step(step)
        score_prot = t._step_marks_touched(step, clock0)
        use_stamp = not score_prot and t.eviction is not None
        # More keys than rows: the kernel counts the distinct hit rows with
        # the stamps.
        marks = use_stamp or n > t.capacity
        stamp = self._next_stamp() if marks else self.dummy_u32
        set_size = _set_size(n)
        if workspace is None:  # this table's own
            if self.workspace.shape[0] < workspace_words(n):
                self.workspace = cp.empty(workspace_words(n), dtype=cp.int64)
            workspace = self.workspace
        if out is None:  # the reused step buffers: rows of one [4, m] array
            buffers = self._step_buffers(n)
            base, stride = buffers.data.ptr, 8 * buffers.shape[1]
            ptrs = [base + i * stride for i in range(4)]
            out = (buffers,)
        else:
            ptrs = [a.data.ptr for a in out]
        record = list(self._static_words())
        record[0:5] = (keys, use, int(has_use), int(first_only), n)
        record[9] = t._size  # the host's part; the kernel adds the account's
        record[11:13] = (step, int(score_prot))
        record[20:22] = (stamp.data.ptr, self.call_stamp)
        record[29:39] = (
            workspace.data.ptr,
            set_size,
            ptrs[0],
            rows32,
            int(step_out),
            fresh,
            *ptrs[1:],
            self.account.data.ptr,
        )
        self.held = [stamp, workspace, *out]
        self.unread = True
        return record

    def _step_buffers(self, n):
        """The reused ``[4, >= n]`` int64 outputs that a step's call writes
        and nobody reads (rows, new rows, evicted keys and rows)."""
        if self.step_outputs.shape[1] < n:
            self.step_outputs = cp.empty((4, n), dtype=cp.int64)
        return self.step_outputs

    def _static_words(self):
        """The record's words fixed by the table's arrays and settings
        (rebuilt when any of them is replaced, e.g. by a resize or import):
        a step's record then costs a few pointer sums, not 40 lookups."""
        t = self.table
        if getattr(t, "_bids", None) is None:
            t._bids = cp.full(t.num_buckets, _NO_BID, dtype=cp.int64)
        arrays = (t.keys, t.digest, t.score, t.load, t.holey, t.bucket_sentinel)
        arrays += (t._bids,)
        settings = (t.salt, t.num_buckets, t.bucket_size, t.capacity, t.eviction)
        settings += (t.admit_after,)
        cached = self.__dict__.get("_static")
        if (
            cached is not None
            and cached[1] == settings
            and all(a is b for a, b in zip(cached[0], arrays))
        ):
            return cached[2]
        words = [0] * DESC_WORDS
        words[5:9] = (
            int(np.uint64(t.salt).view(np.int64)),
            t.num_buckets,
            t.bucket_size,
            t.capacity,
        )
        words[10] = _EVICTION_CODE[t.eviction]
        words[13] = t.admit_after
        words[14:20] = [a.data.ptr for a in arrays[:6]]
        words[22] = t._bids.data.ptr
        # No admission sketch (see `eligible`): the kernel admits every key.
        words[23:29] = (0, self.dummy_u32.data.ptr, 0, 0, 0, self.dummy_u64.data.ptr)
        # The arrays stay referenced here, so their pointers stay valid.
        self._static = (arrays, settings, tuple(words))
        return self._static[2]

    def _next_stamp(self):
        """The protection marks for a new call (no row carries its stamp)."""
        if self.stamp is None or self.call_stamp == np.iinfo(np.uint32).max:
            self.stamp = cp.zeros(self.table.capacity, dtype=cp.uint32)
            self.call_stamp = 0
        self.call_stamp += 1
        return self.stamp


def workspace_words(n):
    """int64 words of a call's scratch for ``n`` keys (the kernel's
    per-key arrays, then its dedup set of at least ``2n`` slots)."""
    return _WORDS_PER_KEY * n + _SET_ARRAYS * _set_size(n)


def _set_size(n):
    """Slots of a call's dedup set: a power of two of at least ``2n - 1``."""
    return 1 << max(2 * n - 1, 1).bit_length()


@contextlib.contextmanager
def clocks_kept_on_error(tables):
    """Sets the tables' clocks back when the block raises: `record` advances
    a table's clock, and a failure before the launch (e.g. out of device
    memory for a later table's buffers) must leave every table as if it
    never saw the call. Interrupts are let through as they are: the
    launch may already be queued."""
    clocks = [(table, table.clock) for table in tables]
    try:
        yield
    except Exception:
        for table, clock in clocks:
            table.clock = clock
        raise
