"""Public ``HashTable``: validates arguments, picks the device, serializes calls."""

from __future__ import annotations

import threading

from .array_table import MIN_BUCKETS
from .call_results import BatchTooLargeError
from .call_results import InsertResult
from .call_results import TableFullError
from .changes import Changes
from .changes import after_call
from .changes import call_step
from .keys import to_numpy_keys
from .numpy_table import NumpyTable
from .scores import check_scores
from .ttl import Expiry
from .ttl import check_ttl_steps
from .ttl import mapped
from .undo import restore
from .undo import state_before

__all__ = [
    "BatchTooLargeError",
    "HashTable",
    "InsertResult",
    "TableFullError",
]

DEFAULT_BUCKET_SIZE = 16  # 16 x 8 B keys = one 128 B line; 16 digests = one 16 B load


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


class HashTable:
    """Maps int64 keys to stable row numbers in ``[0, capacity)`` for embeddings.

    Bucketed open addressing with two candidate buckets per key: a key lives in
    the less loaded of its two buckets and its row is its slot index
    (``bucket * bucket_size + position``).  When both buckets are full the
    lowest-score key among them is evicted (``"lru"``: oldest step seen,
    ``"lfu"``: fewest sightings, counting duplicates within a call; ties go to
    the first bucket's lowest slot) and reported, or with ``eviction=None`` a
    ``TableFullError`` (a ``RuntimeError``) is raised and nothing changes.

    Args:
      capacity: positive int; rounded up to a multiple of ``bucket_size`` and
        to at least 4 buckets.  The ``capacity`` property reports the result.
      bucket_size: positive power of two, default 16.
      eviction: ``"lru"``, ``"lfu"`` or ``None``.
      admit_after: a key gets a row at exactly its ``admit_after``-th
        sighting (exact counts of the keys not admitted yet, in a second
        table of ``capacity`` slots, about 17 bytes each; beyond that cap
        the least-counted pending keys are forgotten; see
        `keras_sparse.table.admission`).
      device: ``"auto"`` (GPU when CuPy sees one), ``"gpu"`` or ``"cpu"``.
      seed: salts the hash functions.
      ttl_steps: None, or an int >= 1: a key not seen by a
        ``lookup_or_insert`` call for ``ttl_steps`` steps is erased at the
        start of the next call (its row free for that call's new keys;
        ``stats()["expired"]``); see `keras_sparse.table.ttl`.
      track_changes: keep each row's step of last change and the keys
        removed with their step, for delta exports (read by
        `keras_sparse.table.change_keys`; see `keras_sparse.table.changes`).

    Batch semantics of ``lookup_or_insert``: duplicates share a row; keys
    found or inserted by a call are never evicted by that same call; a batch
    with more distinct admitted keys than ``capacity`` raises
    ``BatchTooLargeError`` (a ``ValueError``)
    before changing anything; a key whose two buckets are entirely taken by
    keys of the same call gets row -1 (``stats()["overflows"]``).

    Thread safety: every public method holds one re-entrant lock, so
    concurrent calls from several threads are serialized and each sees a
    consistent table.

    Keys: NumPy/CuPy/JAX/TF/torch arrays, lists or ints of any shape, integer
    dtypes only (uint64 is reinterpreted bit for bit).  Results are NumPy on
    the CPU table and CuPy on the GPU table.

    Example:
      >>> table = HashTable(64, eviction="lru", device="cpu")
      >>> res = table.lookup_or_insert([[7, -1], [7, 2**63 - 1]])
      >>> bool(res.rows[0, 0] == res.rows[1, 0])
      True
      >>> sorted(res.new_rows) == sorted(set(res.rows.ravel()))
      True
      >>> table.lookup([7, 12345]).tolist()[1]
      -1
      >>> table.size
      3
    """

    def __init__(
        self,
        capacity,
        *,
        bucket_size=None,
        eviction="lru",
        admit_after=1,
        device="auto",
        seed=0,
        ttl_steps=None,
        track_changes=False,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if bucket_size is None:
            bucket_size = DEFAULT_BUCKET_SIZE
        if (
            isinstance(bucket_size, bool)
            or not isinstance(bucket_size, int)
            or bucket_size <= 0
            or bucket_size & (bucket_size - 1)
        ):
            raise ValueError(
                f"bucket_size must be a positive power of two, got {bucket_size!r}"
            )
        if eviction not in ("lru", "lfu", None):
            raise ValueError(f'eviction must be "lru", "lfu" or None, got {eviction!r}')
        if (
            isinstance(admit_after, bool)
            or not isinstance(admit_after, int)
            or admit_after < 1
        ):
            raise ValueError(f"admit_after must be an int >= 1, got {admit_after!r}")
        check_ttl_steps(ttl_steps)
        if device not in ("auto", "gpu", "cpu"):
            raise ValueError(f'device must be "auto", "gpu" or "cpu", got {device!r}')
        num_buckets = max(-(-capacity // bucket_size), MIN_BUCKETS)
        if num_buckets >= 1 << 32:
            raise ValueError(f"capacity {capacity} needs more than 2**32 buckets")
        if device == "auto":
            device = "gpu" if _gpu_available() else "cpu"
        if device == "gpu":
            if not _gpu_available():
                raise RuntimeError(
                    'device="gpu" but CuPy is not installed or sees no CUDA device'
                )
            from .cupy_table import CupyTable
            from .cupy_table import to_cupy_keys

            self._impl = CupyTable(
                num_buckets, bucket_size, eviction, admit_after, seed
            )
            self._convert = to_cupy_keys
        else:
            self._impl = NumpyTable(
                num_buckets, bucket_size, eviction, admit_after, seed
            )
            self._convert = to_numpy_keys
        self._impl.ttl = None if ttl_steps is None else Expiry(ttl_steps, self._impl)
        self._impl.changes = Changes(self._impl) if track_changes else None
        self._lock = threading.RLock()
        self._version = 0

    # ------------------------------------------------------------ properties
    capacity = property(lambda self: self._impl.capacity, doc="Real number of rows.")
    bucket_size = property(lambda self: self._impl.bucket_size)
    num_buckets = property(lambda self: self._impl.num_buckets)
    eviction = property(lambda self: self._impl.eviction)
    admit_after = property(lambda self: self._impl.admit_after)
    device = property(lambda self: self._impl.device, doc='"cpu" or "gpu".')
    seed = property(lambda self: self._impl.seed)

    @property
    def ttl_steps(self):
        """Steps a key may go unseen before it expires (None: never)."""
        ttl = self._impl.ttl
        return None if ttl is None else ttl.steps

    @property
    def track_changes(self) -> bool:
        """Whether the table keeps change steps (``track_changes=True``)."""
        return self._impl.changes is not None

    @property
    def size(self) -> int:
        return self._impl.size

    @property
    def version(self) -> int:
        """Grows whenever the key->row map changes (a key inserted, evicted,
        erased or imported, or the table cleared); lookups leave it alone.
        Copies of the map (a layer's serving map) compare it to know they
        are stale."""
        return self._version

    @property
    def load_factor(self) -> float:
        return self._impl.size / self._impl.capacity

    def __len__(self):
        return self.size

    def __repr__(self):
        return (
            f"HashTable(capacity={self.capacity}, bucket_size={self.bucket_size}, "
            f"eviction={self.eviction!r}, admit_after={self.admit_after}, "
            f"device={self.device!r}, ttl_steps={self.ttl_steps}, "
            f"size={self.size})"
        )

    # ---------------------------------------------------------------- calls
    def lookup(self, keys, count=True):
        """Rows of ``keys`` (input's shape), -1 where absent.

        Only the hit/miss counters change (none with ``count=False``, a
        read that should not show in `stats`); scores are left alone.
        """
        k, shape = self._convert(keys, "keys")
        with self._lock:
            return self._impl.lookup(k, count).reshape(shape)

    def lookup_or_insert(self, keys, step=None) -> InsertResult:
        """Rows of ``keys``, inserting admitted new keys; see the class docstring.

        ``step`` is the logical time recorded for LRU (default: an internal
        counter incremented per call).  LFU scores add one per occurrence.
        """
        k, shape = self._convert(keys, "keys")
        with self._lock:
            at, gone = call_step(self._impl, step), None
            if self._impl.ttl is not None:
                res, _, gone = mapped(self._impl, k, step, None)
                self._version += gone is not None
            else:
                res = self._impl.lookup_or_insert(k, step)
            self._version += bool(res.new_rows.size)
            after_call(self._impl, res, at, gone)
        return res._replace(rows=res.rows.reshape(shape))

    def lookup_or_insert_fresh(self, keys, step=None, undo=None):
        """``(result, fresh)``: `lookup_or_insert` plus a bool array of the
        keys' shape, True where the key got a new row in this call (the
        embedding rows to re-initialize, per position).

        ``undo``: an object with ``append``, given the call's
        `keras_sparse.table.undo.UndoRecord` under the table's lock (what
        `state_before` needs to show the table as it was before the call).

        Example:
          >>> table = HashTable(64, device="cpu")
          >>> _ = table.lookup_or_insert([5])
          >>> res, fresh = table.lookup_or_insert_fresh([5, 6, 6])
          >>> fresh.tolist()
          [False, True, True]
        """
        k, shape = self._convert(keys, "keys")
        with self._lock:
            at, gone = call_step(self._impl, step), None
            if self._impl.ttl is not None:
                res, fresh, gone = mapped(self._impl, k, step, undo)
                self._version += gone is not None
            elif undo is None:
                res, fresh = self._impl.lookup_or_insert_fresh(k, step)
            else:
                res, fresh = self._impl.lookup_or_insert_fresh(k, step, undo)
            self._version += bool(res.new_rows.size)
            after_call(self._impl, res, at, gone)
        return res._replace(rows=res.rows.reshape(shape)), fresh.reshape(shape)

    @property
    def has_held_keys(self) -> bool:
        """Whether a tier below the table holds keys (`set_held_keys`)."""
        return getattr(self._impl, "held_keys", None) is not None

    def set_held_keys(self, hook):
        """Declares a tier below the table (a row store) that holds keys.

        ``hook(keys) -> (held, scores)``: for the distinct new keys of an
        insert call (NumPy int64), a bool mask of those the tier holds and
        their scores there. A held key is admitted at sight (it was admitted
        before), and under LFU its sightings add to its held score, so an
        evicted key that comes back continues where it left. None removes
        the hook. The hook runs under the table's lock and must not call
        the table.
        """
        with self._lock:
            self._impl.held_keys = hook

    def step_rows(self, keys, use=None, out=None):
        """``(rows, fresh)`` of a training step's keys, flat, with no host sync.

        For GPU tables (None elsewhere, and where the call needs
        `lookup_or_insert_fresh`: ``eviction=None`` or admission counts).
        Batches above 64K keys run on every block of one launch; a batch of
        more keys than the table has rows also reads back whether it held
        too many distinct keys (one host sync, so that the step itself
        raises `BatchTooLargeError`). ``use``: a bool
        device array, False at padding (row -1, not counted); ``fresh`` is
        True only where a new row first appears. ``out``: the flat int32
        ``rows`` and bool ``fresh`` device arrays to write (new ones by
        default). The call's counts and size change stay on the device until
        `stats`, `size` or another call reads them, so steps that only call
        this never wait for the GPU.
        """
        step_rows = getattr(self._impl, "step_rows", None)
        if step_rows is None or self._impl.ttl is not None or self.track_changes:
            # (expiry and change tracking run in `lookup_or_insert_fresh`)
            return None
        k, _ = self._convert(keys, "keys")
        if out is None:
            import cupy as cp

            n = int(k.shape[0])
            out = (cp.empty(n, dtype=cp.int32), cp.empty(n, dtype=cp.bool_))
        with self._lock:
            done = step_rows(k, use, out)
            # May have inserted: copies of the map must not trust it (the
            # count of new rows stays on the device).
            self._version += done is not None
        return done

    def state_before(self, records):
        """`keras_sparse.table.undo.TableState` (live keys, rows, scores,
        clock, pending admission counts) as the table was before the calls that
        wrote the undo ``records`` (a list in call order, or a callable
        returning one, called under the table's lock so that no call runs
        in between). The table is not changed.

        Example:
          >>> table = HashTable(64, device="cpu")
          >>> _ = table.lookup_or_insert([1, 2])
          >>> log = []
          >>> _ = table.lookup_or_insert_fresh([2, 3], undo=log)
          >>> sorted(table.state_before(log).keys.tolist())
          [1, 2]
        """
        with self._lock:
            if callable(records):
                records = records()
            return state_before(self._impl, records)

    def restore(self, state):
        """Puts the table back to ``state``, a `TableState` of this table
        (`state_before`): the same keys at the same rows, scores, clock and
        pending admission counts. The counters are kept.

        Example:
          >>> table = HashTable(64, device="cpu")
          >>> _ = table.lookup_or_insert([1, 2])
          >>> log = []
          >>> _ = table.lookup_or_insert_fresh([2, 3], undo=log)
          >>> table.restore(table.state_before(log))
          >>> sorted(table.export()[0].tolist())
          [1, 2]
        """
        with self._lock:
            self._version += 1
            restore(self._impl, state)

    def undo_calls(self, records):
        """Undoes the table's newest calls, which wrote the undo ``records``
        (call order): `restore` of their `state_before`, under one lock.
        Keys they expired (``ttl_steps``) are back and no longer counted in
        ``stats()["expired"]``; the other counters are kept.

        Example:
          >>> table = HashTable(64, device="cpu", ttl_steps=1)
          >>> _ = table.lookup_or_insert([1])
          >>> log = []
          >>> _ = table.lookup_or_insert_fresh([2], undo=log)
          >>> _ = table.lookup_or_insert_fresh([2], undo=log)  # 1 expires
          >>> table.undo_calls(log)
          >>> table.export()[0].tolist(), table.stats()["expired"]
          ([1], 0)
        """
        with self._lock:
            self._version += 1
            restore(self._impl, state_before(self._impl, records))
            ttl = self._impl.ttl
            if ttl is not None:
                ttl.expired -= sum(
                    int(r.ttl.expired_keys.shape[0])
                    for r in records
                    if r.ttl is not None
                )

    def erase(self, keys) -> int:
        """Remove ``keys`` (absent ones are ignored); returns how many were live."""
        k, _ = self._convert(keys, "keys")
        with self._lock:
            if self._impl.ttl is not None:
                self._impl.ttl.freed(self._impl.find(k))
            changes = self._impl.changes
            if changes is not None:
                live = k[self._impl.find(k) >= 0]
                changes.removed(self._impl, live, self._impl.clock + 1)
            erased = self._impl.erase(k)
            self._version += bool(erased)
            return erased

    def export(self):
        """``(keys, rows, scores)`` of all live entries as 1-D arrays."""
        with self._lock:
            return self._impl.export()

    def import_(self, keys, rows=None, scores=None) -> InsertResult:
        """Restore entries: at exactly ``rows`` when given, else insert and assign rows.

        With ``rows``: raises ``ValueError`` (table unchanged) if a row is out of
        range, used twice, not in one of its key's two buckets (different
        capacity/bucket_size/seed), taken by another key, or if a key is live
        elsewhere.  ``scores`` default to the current step (LRU) or 1 (LFU);
        given ones must lie in ``[0, 2**62)`` (ValueError, table unchanged;
        see `keras_sparse.table.scores`).  Admission is bypassed.
        """
        k, _ = self._convert(keys, "keys")
        r = s = None
        if rows is not None:
            r, _ = self._convert(rows, "rows")
        if scores is not None:
            s, _ = self._convert(scores, "scores")
            check_scores(s)
        with self._lock:
            self._version += 1  # also when it raises half-way: be safe
            res = self._impl.import_(k, r, s)
            if self._impl.ttl is not None:  # imported keys count as seen now
                self._impl.ttl.load(res.rows, int(self._impl.clock))
            # Between training steps: changed as of the next one.
            after_call(self._impl, res, self._impl.clock + 1)
            return res

    def clear(self):
        """Remove every entry and every admission count (counters are kept)."""
        with self._lock:
            changes = self._impl.changes
            if changes is not None:
                changes.removed(
                    self._impl, self._impl.export()[0], self._impl.clock + 1
                )
                changes.clear()
            self._impl.clear()
            if self._impl.ttl is not None:
                self._impl.ttl.clear()
            self._version += 1

    def stats(self) -> dict:
        """Counters (hits, misses, inserts, evictions, rejected_admissions,
        overflows, expired: keys a time to live erased) plus size, capacity
        and load_factor.

        ``hits`` and ``misses`` count key occurrences (duplicates included),
        as if each call's keys arrived one at a time in order: an occurrence
        hits when its key already has a row, including a row given to it by
        an earlier occurrence in the same call. ``rejected_admissions``
        counts the occurrences of keys not yet admitted (``admit_after``),
        the same way. ``inserts`` and ``evictions`` count keys.
        """
        with self._lock:
            out = dict(self._impl.counters)
            ttl = self._impl.ttl
            out["expired"] = 0 if ttl is None else ttl.expired
            out.update(
                size=self.size, capacity=self.capacity, load_factor=self.load_factor
            )
            return out

    def candidate_buckets(self, keys):
        """Diagnostic/test helper: the two candidate buckets of each key."""
        k, shape = self._convert(keys, "keys")
        b1, b2, _ = self._impl.hash(k)
        return b1.reshape(shape), b2.reshape(shape)
