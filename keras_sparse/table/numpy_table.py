"""Bucketed two-choice hash table written once against an array namespace.

``ArrayTable`` holds the whole algorithm in vectorized array operations, with
``xp`` = NumPy (the CPU twin, ``NumpyTable``) or CuPy (``CupyTable`` swaps the
hot probe/scatter steps for CUDA kernels).  Keeping one algorithm makes both
devices give identical rows for identical call sequences.

Layout (row == slot index == bucket * bucket_size + position):

* ``keys``   int64  [capacity]  live key, or the bucket's *sentinel* when empty
* ``digest`` uint8  [capacity]  8-bit fingerprint, compared first on lookup
* ``score``  int64  [capacity]  last step seen (LRU) or times seen (LFU)
* ``load``   int64  [num_buckets] live slots per bucket
* ``holey``  bool   [num_buckets] False guarantees the live slots of the bucket
  are exactly positions ``[0, load)`` (placement fills lowest free slots first,
  so only ``erase`` and ``import_`` with explicit rows can punch holes); lets
  placement compute the r-th free slot as ``load + r`` without reading keys

Empty slots hold a per-bucket sentinel key chosen so that the sentinel's own
candidate buckets exclude that bucket.  A lookup of key ``k`` only inspects
``k``'s candidate buckets, so it can never match an empty slot, every int64
value stays a valid key, and lookups need no occupancy array.  (Requires at
least 4 buckets, which the front class guarantees.)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .admission import ExactCounts
from .keys import bucket_pair
from .keys import digest
from .keys import hash_keys
from .keys import seed_word
from .keys import to_host
from .undo import UndoRecord
from .undo import evicted_log
from .undo import note_evicted

_INT64_MAX = np.iinfo(np.int64).max
# de Bruijn sequence for count-trailing-zeros of an isolated bit (NumPy has no ctz).
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_TABLE = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN_TABLE[((1 << _i) * 0x03F79D71B4CB0A89 & 0xFFFFFFFFFFFFFFFF) >> 58] = _i
MIN_BUCKETS = 4
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _score_of(new_score, idx):
    """Scores for keys ``idx``: one shared 0-d value or a per-key array."""
    return new_score if new_score.ndim == 0 else new_score[idx]


class InsertResult(NamedTuple):
    """Result of ``lookup_or_insert``.

    rows: row per input key (input's shape), -1 for keys not admitted/placed.
    new_rows: unique rows assigned in this call (re-initialize these embeddings).
    evicted_keys, evicted_rows: keys pushed out in this call and their old rows.
    """

    rows: object
    new_rows: object
    evicted_keys: object
    evicted_rows: object


class TableFullError(RuntimeError):
    """Raised with ``eviction=None`` when a key's candidate buckets are full."""


class BatchTooLargeError(ValueError):
    """A call with more distinct keys to place than the table has rows."""


class ArrayTable:
    """Algorithm core; not thread safe (the front class ``HashTable`` locks)."""

    xp = np
    device = "cpu"
    # _place's first round may hand keys without room to _claim_write
    _claim_unroomy = False
    # lookup_or_insert may mark protected slots by score == step (LRU)
    _score_protect = False

    def __init__(self, num_buckets, bucket_size, eviction, admit_after, seed):
        xp = self.xp
        if num_buckets < MIN_BUCKETS:
            raise ValueError(f"need at least {MIN_BUCKETS} buckets, got {num_buckets}")
        self.num_buckets, self.bucket_size = int(num_buckets), int(bucket_size)
        self.capacity = self.num_buckets * self.bucket_size
        self.eviction, self.admit_after, self.seed = (
            eviction,
            int(admit_after),
            int(seed),
        )
        self.salt = seed_word(seed)
        self._sentinels = self._find_sentinels()
        self.keys = xp.empty(self.capacity, dtype=xp.int64)
        self.digest = xp.zeros(self.capacity, dtype=xp.uint8)
        self.score = xp.zeros(self.capacity, dtype=xp.int64)
        self.load = xp.zeros(self.num_buckets, dtype=xp.int64)
        self.holey = xp.zeros(self.num_buckets, dtype=bool)
        self.bucket_sentinel = xp.asarray(self._sentinel_per_bucket())
        self.admission = None
        if self.admit_after > 1:
            # Pending keys in a table of this class and size (the memory cap).
            self.admission = ExactCounts(
                type(self), self.num_buckets, self.bucket_size, seed
            )
        self.size = 0
        self.clock = 0
        self.counters = dict(
            hits=0, misses=0, inserts=0, evictions=0, rejected_admissions=0, overflows=0
        )
        self.clear()

    # ----------------------------------------------------------- primitives
    def _add_at(self, arr, idx, val):
        np.add.at(arr, idx, val)

    def _asarray(self, x, dtype):
        return self.xp.asarray(x, dtype=dtype)

    def _stable_argsort(self, x):
        return np.argsort(x, kind="stable")

    def _to_host_int(self, x) -> int:
        return int(x)

    def _arange(self, n):
        """``arange(n)`` int64 that callers only read."""
        return self.xp.arange(n, dtype=self.xp.int64)

    def hash(self, k):
        """(b1, b2, digest) for flat int64 keys."""
        h = hash_keys(k, self.salt, self.xp)
        b1, b2 = bucket_pair(h, self.num_buckets, self.xp)
        return b1, b2, digest(h, self.xp)

    def _find_sentinels(self):
        # Two keys with disjoint bucket pairs: bucket b's sentinel is s0 unless
        # b is one of s0's buckets, then s1.  Deterministic for (seed, buckets).
        def pair(v):
            h = hash_keys(np.asarray([v], np.int64), self.salt, np)
            b1, b2 = bucket_pair(h, self.num_buckets, np)
            return {int(b1[0]), int(b2[0])}

        s0 = -0x5EED5EED5EED5EED
        p0 = pair(s0)
        for cand in range(1, 1 << 20):
            if not (pair(s0 + cand) & p0):
                return s0, s0 + cand, p0
        raise RuntimeError("no sentinel pair found")  # impossible for >= 4 buckets

    def _sentinel_per_bucket(self):
        s0, s1, p0 = self._sentinels
        sent = np.full(self.num_buckets, s0, np.int64)
        sent[list(p0)] = s1
        return sent

    def _empty_keys(self, slots):
        return self.bucket_sentinel[slots // self.bucket_size]

    # ---------------------------------------------------------------- probe
    def probe(self, k, b1, b2, d):
        """Row of each key, -1 when absent (digest compare, then key verify).

        The 2*S digest matches of a key are packed into a bit mask (one word
        per key for S <= 32); each round verifies the lowest candidate bit
        against the stored key, so a digest false positive costs one more
        round for that key only.
        """
        S = self.bucket_size
        n = k.shape[0]
        rows = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return rows
        bb = np.stack([b1, b2], axis=1)
        # Gather whole digest rows as machine words: far faster than bytes.
        row_dt = _UINT[min(S, 8)]
        dig_rows = self.digest.view(row_dt).reshape(self.num_buckets, -1)
        g = np.take(dig_rows, bb, axis=0).view(np.uint8).reshape(n, 2 * S)
        eq = g == d[:, None]
        packed = np.packbits(eq, axis=1, bitorder="little")
        wbytes = min(packed.shape[1], 8)
        words = packed.view(_UINT[wbytes]).reshape(-1)
        nw = packed.shape[1] // wbytes
        flat_bb = bb.reshape(-1)
        shift = np.int64(S.bit_length() - 1)
        if nw == 1:
            # Dense first round over all keys (most keys have exactly one
            # candidate); only digest false positives go to the sparse rounds.
            vals = words.astype(np.uint64)
            low = vals & (~vals + np.uint64(1))
            pos = _DEBRUIJN_TABLE[(low * _DEBRUIJN) >> np.uint64(58)]
            slot = np.take(flat_bb, np.arange(0, 2 * n, 2) + (pos >> shift)) * S + (
                pos & (S - 1)
            )
            hit = self.keys[slot] == k
            hit &= vals != 0
            np.copyto(rows, slot, where=hit)
            vals ^= low
            ki = np.flatnonzero(vals * ~hit)
            vals, base = vals[ki], 0
        else:
            ki = np.flatnonzero(words)
            vals = words[ki].astype(np.uint64)
            ki, base = ki // nw, (ki % nw) * 64
        while ki.shape[0]:
            low = vals & (~vals + np.uint64(1))
            pos = _DEBRUIJN_TABLE[(low * _DEBRUIJN) >> np.uint64(58)] + base
            slot = flat_bb[2 * ki + (pos >> shift)] * S + (pos & (S - 1))
            hit = self.keys[slot] == k[ki]
            rows[ki[hit]] = slot[hit]
            vals ^= low
            keep = ~hit & (vals != 0)
            ki, vals = ki[keep], vals[keep]
            if nw != 1:
                base = base[keep]
        return rows

    # --------------------------------------------------------------- public
    def find(self, k):
        """Row of each flat int64 key, -1 when absent (hash + probe)."""
        b1, b2, d = self.hash(k)
        return self.probe(k, b1, b2, d)

    def lookup(self, k, count=True):
        rows = self.find(k)
        if count:
            found = self._to_host_int((rows >= 0).sum())
            self.counters["hits"] += found
            self.counters["misses"] += int(k.shape[0]) - found
        return rows

    def _find_for_insert(self, k):
        """``(rows, hit_rows, miss_idx, miss_hash)`` for ``lookup_or_insert``.

        ``hit_rows``: rows of the found keys; ``miss_idx``: positions of the
        absent keys (ascending); ``miss_hash``: their ``(b1, b2, digest)``
        when the probe already computed them (the CPU twin), else None and
        ``_place`` hashes the new keys itself.
        """
        rows = self.find(k)
        return rows, rows[rows >= 0], self.xp.flatnonzero(rows < 0), None

    def _dedup(self, mk):
        """Unique keys of ``mk`` in order of first occurrence.

        Returns ``(first, counts, inv)``: ``mk[first]`` are the unique keys,
        ``counts`` their multiplicities and ``inv`` maps each element of ``mk``
        to its unique key; all three are None when ``mk`` has no duplicates
        (the common case), which ``np.sort`` of the values detects far more
        cheaply than the ``argsort`` the grouping needs.  Arrival order (not
        key order) is what placement ranks by, so a dup-free batch needs no
        permutation at all.
        """
        xp = self.xp
        n = int(mk.shape[0])
        sk = xp.sort(mk)
        if not bool((sk[1:] == sk[:-1]).any()):
            return None, None, None
        order = self._stable_argsort(mk)  # ties keep arrival order
        sk = mk[order]
        is_first = xp.ones(n, dtype=bool)
        is_first[1:] = sk[1:] != sk[:-1]
        starts = xp.flatnonzero(is_first)
        counts = xp.diff(xp.concatenate([starts, xp.asarray([n])]))
        first = order[starts]  # first occurrence of each key, groups in key order
        by_arrival = xp.argsort(first)  # stable ranks not needed: all distinct
        rank = xp.empty(int(starts.shape[0]), dtype=xp.int64)
        rank[by_arrival] = xp.arange(int(starts.shape[0]), dtype=xp.int64)
        inv = xp.empty(n, dtype=xp.int64)
        inv[order] = rank[xp.cumsum(is_first) - 1]
        return first[by_arrival], counts[by_arrival], inv

    def lookup_or_insert(self, k, step=None):
        return self._insert_call(k, step)[0]

    def lookup_or_insert_fresh(self, k, step=None, undo=None):
        """``(InsertResult, fresh)``, ``fresh`` True where the key got a new
        row in this call. ``undo``: a list the call appends its
        `UndoRecord` to (see `keras_sparse.table.undo`)."""
        if undo is None:
            result, miss_idx = self._insert_call(k, step)
        else:
            result, miss_idx = self._recorded_call(k, step, undo)
        # A key missing before this call with a row now got a new row (the
        # call never evicts its own hits), so no search of ``new_rows``.
        fresh = self.xp.zeros(int(k.shape[0]), dtype=bool)
        fresh[miss_idx] = result.rows[miss_idx] >= 0
        return result, fresh

    def _recorded_call(self, k, step, undo):
        """`_insert_call` that appends its `UndoRecord` to ``undo``."""
        self._evicted_log = []
        try:
            return self._insert_call(k, step, undo)
        finally:
            self._evicted_log = None

    def _insert_call(self, k, step, undo=None):
        """``(InsertResult, miss_idx)``: the call, and the positions of the
        keys it did not find (its `UndoRecord` appended to ``undo``)."""
        xp = self.xp
        clock0 = self.clock
        step = self._next_step(step)
        # LRU with every stored score < step (no import_ above the clock):
        # exactly the slots this call touches hold score == step, so that
        # marks them protected from eviction (no capacity-size bool array).
        score_prot = self._score_protect and self._step_marks_touched(step, clock0)
        n = int(k.shape[0])
        rows, hit_rows, miss_idx, miss_hash = self._find_for_insert(k)
        if undo is not None:  # before any score changes (hit_rows: scratch)
            hits = self._record_hits(hit_rows, undo, n)
        counted = None
        n_miss = int(miss_idx.shape[0])
        empty = xp.zeros(0, dtype=xp.int64)
        placed_rows, ev_keys, ev_rows = empty, empty, empty
        rejected = 0
        if n_miss:
            # New keys keep batch (first-occurrence) order: placement ranks
            # them by it, identically on both devices.
            first, counts, inv = self._dedup(k[miss_idx])
            src = miss_idx if first is None else miss_idx[first]  # positions in k
            if counts is None and (
                self.admission is not None or self.eviction == "lfu"
            ):
                counts = xp.ones(int(src.shape[0]), dtype=xp.int64)  # else unused
            admitted = est = None
            held = self._held_below(k[src], counts)
            place_counts = counts
            if held is not None:
                held, place_counts = held
            if self.admission is not None:
                uk = k[src]
                # Counted only once the call has placed its keys: a call
                # that raises leaves the counts as they were.
                est, before = self.admission.peek(uk, counts)
                admitted = est >= self.admit_after
                if held is not None:
                    admitted |= held
                ak_src, acounts = src[admitted], place_counts[admitted]
            else:
                ak_src, acounts = src, place_counts
            hashes = None
            if miss_hash is not None:  # reuse the probe's hashes of these keys
                sel = first  # the unique misses (None: all of them)
                if admitted is not None:
                    adm = xp.flatnonzero(admitted)
                    sel = adm if first is None else first[adm]
                hashes = miss_hash if sel is None else tuple(h[sel] for h in miss_hash)
            self._check_batch_fits(int(ak_src.shape[0]), hit_rows)
            if score_prot:
                self._touch(hit_rows, step)
            placed = self._place(k[ak_src], acounts, step, hit_rows, hashes, score_prot)
            urows = placed[0]
            if self.admission is not None:
                counted = self.admission.commit(
                    uk, counts, before, admitted, record=undo is not None
                )
            if admitted is not None:
                urows_all = xp.full(int(src.shape[0]), -1, dtype=xp.int64)
                urows_all[admitted] = urows
                urows = urows_all
            rows[miss_idx] = urows if inv is None else urows[inv]
            placed_rows, ev_keys, ev_rows = placed[1], placed[2], placed[3]
            misses, rejected = self._miss_counts(n_miss, first, counts, est, urows)
        else:
            score_prot = False
            misses = 0
        if not score_prot:
            self._touch(hit_rows, step)
        c = self.counters
        c["hits"] += n - misses
        c["misses"] += misses
        c["rejected_admissions"] += rejected
        c["inserts"] += int(placed_rows.shape[0])
        c["evictions"] += int(ev_keys.shape[0])
        if undo is not None:
            undo.append(self._undo_record(clock0, hits, placed_rows, counted))
        return InsertResult(rows, placed_rows, ev_keys, ev_rows), miss_idx

    def _held_below(self, keys, counts):
        """``(held, counts)`` for a call's distinct new ``keys`` when a tier
        below the table holds keys (``self.held_keys``, see
        `HashTable.set_held_keys`), else None: held keys are admitted at
        sight, and under LFU their sightings add to their held scores."""
        hook = getattr(self, "held_keys", None)
        if hook is None:
            return None
        held, scores = hook(keys)
        held = self.xp.asarray(held, dtype=bool)
        if self.eviction == "lfu" and bool(held.any()):
            base = self.xp.ones(int(keys.shape[0]), self.xp.int64)
            counts = base if counts is None else counts.astype(self.xp.int64)
            counts = counts + self.xp.where(held, self.xp.asarray(scores), 0)
        return held, counts

    def _record_hits(self, hit_rows, undo, n_keys):
        """``(rows, scores, buffer)``: copies of the found rows (scratch)
        and of their scores, in an array ``undo`` lends (``buffer``, sized
        for the call's ``n_keys``; see `keras_sparse.table.undo`) or in new
        ones (``buffer`` None)."""
        lend = getattr(undo, "buffer", None)
        if lend is None or self.xp is not np:
            return hit_rows.copy(), self.score.take(hit_rows), None
        n = int(hit_rows.shape[0])
        buffer = lend(max(n, n_keys))
        rows, scores = buffer[0, :n], buffer[1, :n]
        rows[...] = hit_rows
        # mode="clip" (the rows are in range): "raise" would gather into a
        # temporary first.
        self.score.take(hit_rows, out=scores, mode="clip")
        return rows, scores, buffer

    def _undo_record(self, clock0, hits, placed_rows, counted):
        """The call's `UndoRecord` (its evictions noted by `note_evicted`)."""
        xp = self.xp
        log = evicted_log(self)
        if log:
            ev = [xp.concatenate(part) for part in zip(*log)]
        else:
            ev = [xp.zeros(0, dtype=xp.int64)] * 3
        rows, scores, buffer = hits
        return UndoRecord(
            clock0, rows, scores, placed_rows, ev[1], ev[0], ev[2], counted, buffer
        )

    def _miss_counts(self, n_miss, first, counts, est, urows):
        """``(misses, rejected_admissions)`` of a call's absent keys, counted
        as if its keys arrived one at a time in batch order.

        A sighting misses while its key has no row: the sightings up to and
        including the one that reaches ``admit_after`` (the key had
        ``est - counts`` sightings before this call), or all of them when the key got
        no row; the later duplicates find the row the call gave the key and
        hit. Counted per sighting, a batch's counts do not depend on how its
        keys are grouped into calls, so shuffled or differently batched data
        gives the same counts (without evictions).

        ``first``: None when the absent keys are distinct (``counts`` then
        all ones or None); ``urows``: each distinct absent key's row, -1 for
        none.
        """
        xp = self.xp
        if first is None:  # each absent key seen once: each sighting misses
            if est is None:
                return n_miss, 0
            return n_miss, self._to_host_int((est < self.admit_after).sum())
        if est is None:  # admit_after == 1: the first sighting admits
            upto = xp.ones_like(counts)
            admitted = counts.shape[0]
        else:
            before = est - counts
            upto = xp.minimum(counts, xp.maximum(self.admit_after - before, 1))
            admitted = (est >= self.admit_after).sum()
        misses = xp.where(urows >= 0, upto, counts).sum()
        # The sightings before the admitting one are rejected; an unadmitted
        # key has upto == counts: all of its sightings.
        rejected = upto.sum() - admitted
        pair = to_host(xp.stack([xp.asarray(misses), xp.asarray(rejected)]))
        return int(pair[0]), int(pair[1])

    def erase(self, k) -> int:
        xp, S = self.xp, self.bucket_size
        rows = self.find(k)
        rows = xp.unique(rows[rows >= 0])
        n = int(rows.shape[0])
        if n:
            self.keys[rows] = self._empty_keys(rows)
            self.digest[rows] = 0
            self.score[rows] = 0
            self._add_at(self.load, rows // S, xp.full(n, -1, dtype=xp.int64))
            self.holey[rows // S] = True
            self.size -= n
        return n

    def export(self):
        xp = self.xp
        live = self.keys != xp.repeat(self.bucket_sentinel, self.bucket_size)
        rows = xp.flatnonzero(live).astype(xp.int64)
        return self.keys[rows], rows, self.score[rows]

    def import_(self, k, rows=None, scores=None):
        xp, S = self.xp, self.bucket_size
        n = int(k.shape[0])
        if n and int(xp.unique(k).shape[0]) != n:
            raise ValueError("import_: keys contain duplicates")
        if scores is not None and int(scores.shape[0]) != n:
            raise ValueError(f"import_: got {int(scores.shape[0])} scores for {n} keys")
        default_score = self.clock if self.eviction == "lru" else 1
        if scores is None:
            scores = xp.full(n, default_score, dtype=xp.int64)
        elif n and self._to_host_int(scores.max()) > self.clock:
            self._score_above_clock = True  # until clear()
        if rows is None:
            b1, b2, d = self.hash(k)
            cur = self.probe(k, b1, b2, d)
            present = cur >= 0
            new_idx = xp.flatnonzero(~present)
            self._check_batch_fits(int(new_idx.shape[0]), cur[present])
            out_rows, placed, evk, evr = self._place(
                k[new_idx],
                xp.ones(int(new_idx.shape[0]), xp.int64),
                self.clock,
                cur[present],
            )
            cur[new_idx] = out_rows
            ok = cur >= 0
            self.score[cur[ok]] = scores[ok]
            self.counters["inserts"] += int(placed.shape[0])
            self.counters["evictions"] += int(evk.shape[0])
            return InsertResult(cur, placed, evk, evr)
        if int(rows.shape[0]) != n:
            raise ValueError(f"import_: got {int(rows.shape[0])} rows for {n} keys")
        self._validate_import_rows(k, rows)
        b = rows // S
        fresh = self.keys[rows] != self.bucket_sentinel[b]  # occupied (by the same key)
        newly = rows[~fresh]
        self.keys[rows] = k
        self.digest[rows] = self.hash(k)[2]
        self.score[rows] = scores
        self._add_at(
            self.load, newly // S, xp.ones(int(newly.shape[0]), dtype=xp.int64)
        )
        if newly.shape[0]:
            self._recheck_holes(newly // S)
        self.size += int(newly.shape[0])
        self.counters["inserts"] += int(newly.shape[0])
        empty = xp.zeros(0, dtype=xp.int64)
        return InsertResult(rows, newly, empty, empty)

    def _validate_import_rows(self, k, rows):
        xp, S = self.xp, self.bucket_size
        n = int(k.shape[0])
        if n == 0:
            return
        if bool(((rows < 0) | (rows >= self.capacity)).any()):
            raise ValueError(f"import_: rows must be in [0, {self.capacity})")
        if int(xp.unique(rows).shape[0]) != n:
            raise ValueError("import_: two keys were given the same row")
        b1, b2, d = self.hash(k)
        bucket = rows // S
        if bool(((bucket != b1) & (bucket != b2)).any()):
            raise ValueError(
                "import_: a row is not in either candidate bucket of its key "
                "(exported from a table with another capacity, bucket_size or seed?)"
            )
        cur = self.probe(k, b1, b2, d)
        if bool(((cur >= 0) & (cur != rows)).any()):
            raise ValueError("import_: a key is already live at a different row")
        occupant = self.keys[rows]
        occupied = occupant != self.bucket_sentinel[bucket]
        if bool((occupied & (occupant != k)).any()):
            raise ValueError("import_: a row is already used by a different live key")

    def _recheck_holes(self, buckets):
        """Recomputes ``holey`` for ``buckets`` after writes at given rows.

        A checkpoint restored at its saved rows is usually compact; marking
        every touched bucket holey would put all later inserts on the slower
        path that reads keys to find free slots.
        """
        xp, S = self.xp, self.bucket_size
        ub = xp.unique(buckets)
        live = self.keys.reshape(-1, S)[ub] != self.bucket_sentinel[ub][:, None]
        prefix = xp.arange(S, dtype=xp.int64)[None, :] < self.load[ub][:, None]
        self.holey[ub] = (live != prefix).any(axis=1)

    def clear(self):
        xp = self.xp
        self.keys[...] = xp.repeat(self.bucket_sentinel, self.bucket_size)
        self.digest.fill(0)
        self.score.fill(0)
        self.load.fill(0)
        self.holey.fill(False)
        self.size = 0
        self._score_above_clock = False
        if self.admission is not None:
            self.admission.clear()

    # ------------------------------------------------------------- internals
    def _next_step(self, step):
        if step is None:
            self.clock += 1
            return self.clock
        step = int(step)
        self.clock = max(self.clock, step)
        return step

    def _step_marks_touched(self, step, clock0):
        """LRU with every stored score below ``step``: exactly the slots a
        call at ``step`` touches hold ``score == step`` (``clock0``: the
        clock before the call)."""
        return (
            self.eviction == "lru"
            and step > clock0
            and not self.__dict__.get("_score_above_clock", False)
        )

    def _touch(self, hit_rows, step):
        """Scores of keys found by lookup_or_insert (duplicates count for LFU)."""
        if not hit_rows.shape[0] or self.eviction is None:
            return
        if self.eviction == "lru":
            self.score[hit_rows] = step
        else:
            self._add_at(
                self.score,
                hit_rows,
                self.xp.ones(hit_rows.shape[0], dtype=self.xp.int64),
            )

    def _check_batch_fits(self, n_new, hit_rows):
        if n_new == 0:
            return
        n_hit = int(hit_rows.shape[0])
        if n_new + n_hit > self.capacity:
            n_hit = int(self.xp.unique(hit_rows).shape[0])
        if n_new + n_hit > self.capacity:
            raise BatchTooLargeError(
                f"batch has {n_new + n_hit} distinct admitted keys but the table "
                f"capacity "
                f"is {self.capacity}; split the batch or grow the table"
            )
        if self.eviction is None and n_new > self.capacity - self.size:
            raise TableFullError(
                f"hash table full: capacity {self.capacity}, size {self.size}, "
                f"{n_new} new keys and eviction=None"
            )

    def _place(self, ak, counts, step, hit_rows, hashes=None, score_prot=False):
        """Give rows to new unique keys ``ak`` (``hashes``: their ``hash``, if known).

        ``counts`` (sightings per key) is only read for LFU and may be None otherwise.

        Rounds: keys whose candidate buckets have room go to the less loaded
        one (ties -> first bucket), ranked within the bucket so each gets a
        distinct free slot; keys whose buckets are both full evict the
        lowest-score slot among both buckets that this call has not touched.
        Returns (rows per key, new rows, evicted keys, evicted rows).
        """
        xp, S = self.xp, self.bucket_size
        m = int(ak.shape[0])
        res = xp.full(m, -1, dtype=xp.int64)
        empty = xp.zeros(0, dtype=xp.int64)
        if m == 0:
            return res, empty, empty, empty
        b1, b2, d = self.hash(ak) if hashes is None else hashes
        # per key for LFU; one 0-d value (broadcast by _score_of) otherwise
        new_score = (
            xp.asarray(step, dtype=xp.int64)
            if self.eviction != "lfu"
            else counts.astype(xp.int64)
        )
        pending = all_keys = self._arange(m)
        filled = []  # slots taken from free space (undo list for TableFullError)
        ev_k, ev_r = [], []
        # score_prot: protected slots are those with score == step (hits
        # already touched, and every slot written here gets score step)
        prot = step if score_prot else None
        max_rounds = 4 * S + 8  # each round places or retires >= 1 key per slot
        for round_ in range(max_rounds):
            if not pending.shape[0]:
                break
            everyone = pending is all_keys  # first round: pending == arange(m)
            pb1, pb2 = (b1, b2) if everyone else (b1[pending], b2[pending])
            choose, roomy = self._choose_buckets(pb1, pb2)
            n_roomy = self._to_host_int(roomy.sum())
            all_roomy = n_roomy == int(pending.shape[0])
            full_keys = empty if all_roomy else pending[~roomy]
            retry = []
            if n_roomy:
                if everyone and not all_roomy and self._claim_unroomy:
                    # A key without room chose a full bucket, so it (and every
                    # other key of that bucket) loses its claim: claiming with
                    # all keys gives the same winners, keeps ``a`` the
                    # identity and saves compacting the roomy keys.
                    won, slots, lost = self._claim_write(
                        pending, choose, ak, d, new_score
                    )
                    lost = lost[roomy[lost]]
                else:
                    a = pending if all_roomy else pending[roomy]
                    if not all_roomy:
                        choose = choose[roomy]
                    won, slots, lost = self._claim_write(a, choose, ak, d, new_score)
                self._add_at(
                    self.load, slots // S, xp.ones(int(slots.shape[0]), dtype=xp.int64)
                )
                res[won] = slots
                filled.append(slots)
                if prot is not None and not score_prot:
                    prot[slots] = True
                retry.append(lost)
            if full_keys.shape[0]:
                if self.eviction is None:
                    self._undo_fill(filled)
                    raise TableFullError(
                        f"hash table full: both candidate buckets of a key are full "
                        f"(capacity {self.capacity}, size {self.size}) "
                        "and eviction=None"
                    )
                if prot is None:
                    prot = xp.zeros(self.capacity, dtype=bool)
                    prot[hit_rows] = True
                    for f in filled:
                        prot[f] = True
                    for r in ev_r:
                        prot[r] = True
                if not n_roomy:
                    # Eviction frees no slot, so every later round evicts too.
                    pending, ek, er = self._evict_rounds(
                        full_keys, b1, b2, ak, d, new_score, res, prot,
                        max_rounds - round_,
                    )  # fmt: skip
                    ev_k += ek
                    ev_r += er
                    break
                lost, ek, er = self._evict_round(
                    full_keys, b1, b2, ak, d, new_score, res, prot
                )
                retry.append(lost)
                if ek.shape[0]:
                    ev_k.append(ek)
                    ev_r.append(er)
            pending = xp.concatenate(retry) if retry else empty
        n_over = int(pending.shape[0])
        self.counters["overflows"] += n_over
        n_filled = sum(int(f.shape[0]) for f in filled)
        self.size += n_filled
        evk = xp.concatenate(ev_k) if ev_k else empty
        evr = xp.concatenate(ev_r) if ev_r else empty
        return res, res[res >= 0], evk, evr

    def _choose_buckets(self, b1, b2):
        """Less loaded candidate bucket per key (ties: first), and has it room."""
        xp, S = self.xp, self.bucket_size
        l1, l2 = self.load[b1], self.load[b2]
        return xp.where(l1 <= l2, b1, b2), xp.minimum(l1, l2) < S

    def _claim_write(self, a, choose, ak, d, new_score):
        """One placement round: a distinct free slot per key in its chosen bucket.

        ``a`` indexes ``ak``; ``choose[i]`` is the bucket of ``a[i]``.  Keys
        are ranked within their bucket by position in ``a``; rank r takes the
        r-th lowest free position, if there is one.  Sorting one composite
        word (bucket, position) groups the buckets without an argsort, and
        compact buckets (see ``holey``) need no key reads.  Writes the winners
        and returns ``(won, slots, lost)``: placed indices into ``ak`` (any
        order), their slots, and the unplaced ones in ``a``'s order.
        """
        xp, S = self.xp, self.bucket_size
        n = int(choose.shape[0])
        sh = max(n - 1, 1).bit_length()
        comp = xp.sort((choose << sh) | xp.arange(n, dtype=xp.int64))
        sc = comp >> sh
        order = comp & ((1 << sh) - 1)
        first = xp.ones(n, dtype=bool)
        first[1:] = sc[1:] != sc[:-1]
        starts = xp.flatnonzero(first)
        grp = xp.cumsum(first) - 1
        rank = xp.arange(n, dtype=xp.int64) - starts[grp]
        lsc = self.load[sc]
        ok = rank < (S - lsc)
        pos = xp.minimum(lsc + rank, S - 1)
        ub = sc[starts]
        hole = self.holey[ub]
        if bool(hole.any()):
            hub = ub[hole]
            occ = self.keys.reshape(-1, S)[hub] != self.bucket_sentinel[hub][:, None]
            free_first = xp.argsort(
                occ.astype(xp.int64) * S + xp.arange(S, dtype=xp.int64), axis=1
            )
            hid = xp.cumsum(hole) - 1  # row of each holey group in free_first
            sel = hole[grp]
            g = grp[sel]
            pos[sel] = free_first[hid[g], xp.minimum(rank[sel], S - 1)]
        slots = (sc * S + pos)[ok]
        won = a[order[ok]]
        lost = a[xp.sort(order[~ok])]
        self._write(slots, ak[won], d[won], _score_of(new_score, won))
        return won, slots, lost

    def _evict_rounds(self, keys_idx, b1, b2, ak, d, new_score, res, prot, rounds):
        """Up to ``rounds`` eviction rounds of keys whose buckets are all full.

        Returns (indices still pending, [evicted keys], [their rows]), the
        lists in round order.
        """
        ev_k, ev_r = [], []
        for _ in range(rounds):
            if not keys_idx.shape[0]:
                break
            keys_idx, ek, er = self._evict_round(
                keys_idx, b1, b2, ak, d, new_score, res, prot
            )
            if ek.shape[0]:
                ev_k.append(ek)
                ev_r.append(er)
        return keys_idx, ev_k, ev_r

    def _evict_round(self, keys_idx, b1, b2, ak, d, new_score, res, prot):
        """One eviction round; returns (indices still pending, evicted keys, rows)."""
        xp, S = self.xp, self.bucket_size
        lane = xp.arange(S, dtype=xp.int64)
        cand = xp.concatenate(
            [b1[keys_idx][:, None] * S + lane, b2[keys_idx][:, None] * S + lane], axis=1
        )
        sc = self.score[cand]
        if isinstance(prot, int):  # protected == score is the step
            step, prot = prot, None
            sc[sc == step] = _INT64_MAX
        else:
            step = None
            sc[prot[cand]] = _INT64_MAX
        pick = xp.argmin(sc, axis=1)  # first minimum: bucket 1 before 2, low slot first
        victim = xp.take_along_axis(cand, pick[:, None], axis=1)[:, 0]
        usable = ~prot[victim] if step is None else self.score[victim] != step
        # Both buckets hold only keys of this call: the key overflows (row -1).
        self.counters["overflows"] += int(keys_idx.shape[0]) - self._to_host_int(
            usable.sum()
        )
        keys_idx, victim = keys_idx[usable], victim[usable]
        if not keys_idx.shape[0]:
            e = xp.zeros(0, dtype=xp.int64)
            return e, e, e
        _, win = xp.unique(
            victim, return_index=True
        )  # earliest key wins a contended slot
        won = xp.zeros(int(keys_idx.shape[0]), dtype=bool)
        won[win] = True
        wi, slots = keys_idx[won], victim[won]
        ek = self.keys[slots].copy()
        note_evicted(self, slots)
        self._write(slots, ak[wi], d[wi], _score_of(new_score, wi))
        if step is None:
            prot[slots] = True
        res[wi] = slots
        return keys_idx[~won], ek, slots

    def _write(self, slots, k, d, s):
        self.keys[slots] = k
        self.digest[slots] = d
        self.score[slots] = s

    def _undo_fill(self, filled):
        xp = self.xp
        for slots in filled:
            self.keys[slots] = self._empty_keys(slots)
            self.digest[slots] = 0
            self.score[slots] = 0
            self._add_at(
                self.load,
                slots // self.bucket_size,
                xp.full(int(slots.shape[0]), -1, dtype=xp.int64),
            )
            self.holey[slots // self.bucket_size] = True


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BYTES = np.uint64(0x0101010101010101)
_CHUNK = 1 << 15  # keys per probe chunk: every temporary stays in L2
_IOTA = np.arange(0, dtype=np.int64)


def _iota(n):
    """Read-only ``arange(n)`` view of one shared, growing array."""
    global _IOTA
    if _IOTA.shape[0] < n:
        _IOTA = np.arange(max(n, 2 * _IOTA.shape[0]), dtype=np.int64)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


class NumpyTable(ArrayTable):
    """CPU twin: the algorithm above on NumPy arrays.

    ``find`` (lookup, the probe of ``lookup_or_insert``, erase) runs a fused,
    chunked version of ``probe`` for bucket sizes 8/16/32: per chunk of keys it
    hashes, gathers both buckets' digests as 64-bit words, XORs them with the
    key's digest repeated in every byte, turns zero bytes into a match mask
    (one word per key) and verifies the lowest match against the stored key.
    Results are identical to ``probe``; chunking keeps temporaries in cache.
    """

    xp = np
    device = "cpu"
    _claim_unroomy = True
    _score_protect = True

    def _arange(self, n):
        return _iota(n)

    def _scratch(self, name, n, dtype):
        """Length-``n`` view of a per-table buffer kept across calls.

        For full-size temporaries that never outlive one call: a fresh
        multi-MiB array costs a page fault per 4 KiB on every call.
        """
        bufs = self.__dict__.setdefault("_bufs", {})
        b = bufs.get(name)
        if b is None or b.shape[0] < n:
            b = bufs[name] = np.empty(n, dtype=dtype)
        return b[:n]

    def hash(self, k):
        """Same values as ``ArrayTable.hash`` with fewer temporaries."""
        h = k.view(np.uint64) ^ np.uint64(self.salt)
        h ^= h >> np.uint64(30)
        h *= _M1
        h ^= h >> np.uint64(27)
        h *= _M2
        h ^= h >> np.uint64(31)
        u32, nb = np.uint64(32), np.uint64(self.num_buckets)
        b1 = h >> u32
        b1 *= nb
        b1 >>= u32
        b2 = h & np.uint64(0xFFFFFFFF)
        b2 *= np.uint64(self.num_buckets - 1)
        b2 >>= u32
        b2 += b1
        b2 += np.uint64(1)
        np.minimum(b2, b2 - nb, out=b2)
        return b1.view(np.int64), b2.view(np.int64), h.astype(np.uint8)

    def find(self, k):
        if self.bucket_size not in (8, 16, 32):
            return super().find(k)
        return self._find_chunked(k, None)

    def _find_for_insert(self, k):
        """The chunked find, also splitting hits and misses for the insert.

        Each chunk compacts its hit rows and its misses (with their bucket
        pair and digest) while they are still in cache, which saves rehashing
        the new keys and two full-size compaction passes over ``rows``.
        """
        if self.bucket_size not in (8, 16, 32):
            return super()._find_for_insert(k)
        n = int(k.shape[0])
        # Filled front to back by the chunks; views of the used prefixes are
        # returned (no concatenation pass).
        # Scratch buffers: all of these die with the lookup_or_insert call.
        split = dict(
            hit_rows=self._scratch("hit_rows", n, np.int64),
            miss_idx=self._scratch("miss_idx", n, np.int64),
            b1=self._scratch("b1", n, np.int64),
            b2=self._scratch("b2", n, np.int64),
            digest=self._scratch("digest", n, np.uint8),
            n_hit=0,
            n_miss=0,
            rest=[],
        )
        rows = self._find_chunked(k, split)
        nh, nm = split["n_hit"], split["n_miss"]
        if split["rest"]:
            # Keys whose first digest candidate was a false positive: probe
            # their remaining candidates in one go, then move the ones found
            # from the miss lists (ascending, so positions by searchsorted)
            # to the hits.
            gi, vals, bb = (np.concatenate(x, axis=-1) for x in zip(*split["rest"]))
            found = np.full(gi.shape[0], -1, dtype=np.int64)
            self._probe_rest(k.take(gi), bb, np.arange(gi.shape[0]), vals, found)
            fi = np.flatnonzero(found >= 0)
            if fi.shape[0]:
                gi, found = gi.take(fi), found.take(fi)
                rows[gi] = found
                at = np.searchsorted(split["miss_idx"][:nm], gi)
                keep = np.ones(nm, dtype=bool)
                keep[at] = False
                for name in ("miss_idx", "b1", "b2", "digest"):
                    arr = split[name]
                    arr[: nm - fi.shape[0]] = arr[:nm][keep]
                nm -= fi.shape[0]
                # hit_rows stays in batch order: gi - at hits precede key gi
                gi -= at
                hit_rows = np.insert(split["hit_rows"][:nh], gi, found)
                nh = hit_rows.shape[0]
                split["hit_rows"] = hit_rows
        hashes = tuple(split[name][:nm] for name in ("b1", "b2", "digest"))
        return rows, split["hit_rows"][:nh], split["miss_idx"][:nm], hashes

    def _find_chunked(self, k, split):
        S = self.bucket_size
        n = int(k.shape[0])
        rows = np.empty(n, dtype=np.int64)  # every chunk writes all its rows
        # One void item per bucket's digests: a single fast 8/16/32-byte gather.
        digv = self.digest.view(np.dtype((np.void, S)))
        mask_dt = _UINT[S // 8]
        W = S // 8  # digest words per bucket
        shift = S.bit_length() - 1
        nb = np.uint64(self.num_buckets)
        nb1 = np.uint64(self.num_buckets - 1)
        salt = np.uint64(self.salt)
        u32, bits = np.uint64(32), np.uint64(S)
        keys, c = self.keys, _CHUNK
        for s in range(0, n, c):
            kc = k[s : s + c]
            m = kc.shape[0]
            # splitmix64 (keys.mix64) and keys.bucket_pair, inlined in place.
            h = kc.view(np.uint64) ^ salt
            h ^= h >> np.uint64(30)
            h *= _M1
            h ^= h >> np.uint64(27)
            h *= _M2
            h ^= h >> np.uint64(31)
            bb = np.empty((2, m), dtype=np.uint64)  # [first buckets, second]
            b1, b2 = bb[0], bb[1]
            np.right_shift(h, u32, out=b1)
            b1 *= nb
            b1 >>= u32
            np.bitwise_and(h, np.uint64(0xFFFFFFFF), out=b2)
            b2 *= nb1
            b2 >>= u32
            b2 += b1
            b2 += np.uint64(1)
            np.minimum(b2, b2 - nb, out=b2)  # wraps: b2 - nb is huge if b2 < nb
            h &= np.uint64(0xFF)
            h *= _BYTES  # the key's digest in every byte
            bbi = bb.view(np.int64)
            g = digv.take(bbi).view(np.uint64).reshape(2, -1)  # (2, m * W)
            g ^= (h if W == 1 else h.repeat(W))[None, :]
            # zero byte == digest match; flat packbits of S bools per bucket
            mk = np.packbits((g.view(np.uint8) == 0).reshape(-1), bitorder="little")
            mk = mk.view(mask_dt).reshape(2, m)
            vals = mk[1].astype(np.uint64)
            vals <<= bits
            vals |= mk[0]
            low = vals & (~vals + np.uint64(1))
            pos = low * _DEBRUIJN
            pos >>= np.uint64(58)
            pos = _DEBRUIJN_TABLE.take(pos)
            sel = pos >> shift  # 0: first bucket, 1: second
            sel *= m
            sel += np.arange(m)
            slot = bbi.reshape(-1).take(sel)
            slot *= S
            pos &= S - 1
            slot += pos
            # No digest match (vals == 0, e.g. most new keys): read slot 0,
            # which stays in cache, instead of a random line of ``keys``, and
            # mask the comparison (slot 0 may hold kc as its empty sentinel).
            cand = vals != 0
            slot *= cand
            hit = keys.take(slot) == kc
            hit &= cand
            miss = hit.view(np.int8).astype(np.int64)
            miss -= 1  # 0 where hit, -1 (all ones) where not
            slot |= miss
            out = rows[s : s + m]
            out[...] = slot
            more = vals != low  # other candidates left ...
            np.greater(more, hit, out=more)  # ... and the first one failed
            ki = np.flatnonzero(more)
            if ki.shape[0]:
                rest = vals.take(ki)
                rest ^= low.take(ki)
                if split is None:
                    self._probe_rest(kc, bbi, ki, rest, out)
                else:
                    # Deferred to one _probe_rest after the loop (a few
                    # hundred keys per chunk: per-round overhead dominates);
                    # until then they count as misses (their row is -1).
                    split["rest"].append((ki + s, rest, bbi.take(ki, axis=1)))
            if split is not None:
                # flatnonzero + take: boolean-mask indexing of a random 50/50
                # mask is several times slower (branch mispredictions).
                miss = out < 0
                mi = np.flatnonzero(miss)
                np.logical_not(miss, out=miss)
                hi = np.flatnonzero(miss)
                a, b = split["n_hit"], split["n_miss"]
                e = b + mi.shape[0]
                out.take(hi, out=split["hit_rows"][a : a + hi.shape[0]])
                np.add(mi, s, out=split["miss_idx"][b:e])
                bbi[0].take(mi, out=split["b1"][b:e])
                bbi[1].take(mi, out=split["b2"][b:e])
                # h is digest * 0x0101..: its low byte is the digest
                split["digest"][b:e] = h.take(mi)
                split["n_hit"], split["n_miss"] = a + hi.shape[0], e
        return rows

    def _choose_buckets(self, b1, b2):
        """``ArrayTable._choose_buckets`` in cache-sized chunks (same result)."""
        n, S, load = int(b1.shape[0]), self.bucket_size, self.load
        choose = np.empty(n, dtype=np.int64)
        roomy = np.empty(n, dtype=bool)
        for s in range(0, n, _CHUNK):
            e = min(s + _CHUNK, n)
            c1, c2 = b1[s:e], b2[s:e]
            l1, l2 = load.take(c1), load.take(c2)
            # choose = b1 where l1 <= l2 else b2, branch-free
            le = np.less_equal(l1, l2).view(np.int8).astype(np.int64)
            np.negative(le, out=le)
            ch = choose[s:e]
            np.bitwise_xor(c1, c2, out=ch)
            ch &= le
            ch ^= c2
            np.minimum(l1, l2, out=l1)
            np.less(l1, S, out=roomy[s:e])
        return choose, roomy

    def _claim_write(self, a, choose, ak, d, new_score):
        """``ArrayTable._claim_write`` in cache-sized chunks (same result).

        Only for rounds whose chosen buckets are all compact (the usual case;
        see ``holey``), where the r-th key of a bucket simply takes position
        ``load + r``.  After one global sort of (bucket, arrival) words, each
        chunk of the sorted words ranks, places and writes its keys with
        temporaries that stay in cache (full-size temporaries cost a page
        fault per 4 KiB on every call).  The rank is the distance to the
        bucket group's head, found by a running maximum of head indices; a
        group split over two chunks carries its head over.  The table writes
        go out at ascending slots, so they are nearly sequential.
        """
        S, n = self.bucket_size, int(choose.shape[0])
        if n == 0 or self.holey.take(choose).any():
            return super()._claim_write(a, choose, ak, d, new_score)
        sh = max(n - 1, 1).bit_length()
        comp = np.left_shift(choose, sh, out=self._scratch("comp", n, np.int64))
        comp |= _iota(n)
        comp.sort()  # (bucket, arrival) words: groups buckets, arrival inside
        # a has all len(ak) keys only in _place's first round with every key
        # roomy (pending shrinks every round), where it is arange(len(ak)):
        # the arrival index already is the key index.
        identity = n == int(ak.shape[0])
        if identity:  # first round: the only one, so scratch is safe
            won_all = self._scratch("won", n, np.int64)
            slots_all = self._scratch("slots", n, np.int64)
        else:  # later rounds: _place still holds the first round's slots
            won_all = np.empty(n, dtype=np.int64)
            slots_all = np.empty(n, dtype=np.int64)
        n_won, lost = 0, []
        head_bucket, head = -1, 0  # bucket and head index of the last group
        mask = (1 << sh) - 1
        for s in range(0, n, _CHUNK):
            c = comp[s : s + _CHUNK]
            m = c.shape[0]
            bkt = c >> sh
            idx = np.arange(s, s + m, dtype=np.int64)
            heads = np.empty(m, dtype=np.int64)
            np.multiply(idx[1:], bkt[1:] != bkt[:-1], out=heads[1:])
            heads[0] = head if bkt[0] == head_bucket else s
            np.maximum.accumulate(heads, out=heads)
            head_bucket, head = int(bkt[-1]), int(heads[-1])
            rank = idx
            rank -= heads  # position of the key within its bucket's group
            slot = self.load.take(bkt)
            free = S - slot
            slot += rank
            bkt *= S
            slot += bkt  # bucket * S + load + rank
            arrival = c & mask
            ok = rank < free
            if not ok.all():
                lost.append(arrival[~ok])
                ok = np.flatnonzero(ok)
                slot, arrival = slot.take(ok), arrival.take(ok)
            won = arrival if identity else a.take(arrival)
            e = n_won + won.shape[0]
            won_all[n_won:e], slots_all[n_won:e] = won, slot
            n_won = e
            self._write(slot, ak.take(won), d.take(won), _score_of(new_score, won))
        lost = a.take(np.sort(np.concatenate(lost))) if lost else a[:0]
        return won_all[:n_won], slots_all[:n_won], lost

    def _evict_round(self, keys_idx, b1, b2, ak, d, new_score, res, prot):
        """``ArrayTable._evict_round`` from per-bucket minima (same result).

        The generic round gathers all ``2 * bucket_size`` candidate scores of
        every key, although keys outnumber buckets when a full table takes a
        large batch (and every round repeats it for the keys that lost).
        The first minimum over [first bucket's lanes, second bucket's lanes]
        is the first bucket's minimum when that is ``<=`` the second's, else
        the second's, so one (min, argmin) per bucket gives the same victim.
        Minima come from the whole score array when the keys' buckets cover
        most of it (one sequential pass), else from the keys' own buckets.
        """
        S = self.bucket_size
        n = int(keys_idx.shape[0])
        kb1, kb2 = b1.take(keys_idx), b2.take(keys_idx)
        step = prot if isinstance(prot, int) else None
        if 2 * n >= self.num_buckets:
            bmin, bpos = self._bucket_minima(None, prot)
            m1, m2 = bmin.take(kb1), bmin.take(kb2)
            p1, p2 = bpos.take(kb1), bpos.take(kb2)
        else:
            m1, p1 = self._bucket_minima(kb1, prot)
            m2, p2 = self._bucket_minima(kb2, prot)
        first = m1 <= m2  # ties: the first bucket (its lanes come first)
        kb1 *= S
        kb1 += p1
        kb2 *= S
        kb2 += p2
        victim = np.where(first, kb1, kb2)
        if step is None:
            usable = ~prot.take(victim)
        else:
            usable = self.score.take(victim) != step
        # Both buckets hold only keys of this call: the key overflows (row -1).
        n_use = int(np.count_nonzero(usable))
        self.counters["overflows"] += n - n_use
        if n_use < n:
            keep = np.flatnonzero(usable)
            keys_idx, victim = keys_idx.take(keep), victim.take(keep)
            n = n_use
        if not n:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e
        won = self._first_claims(victim)
        wi, slots = keys_idx[won], victim[won]
        ek = self.keys.take(slots)
        note_evicted(self, slots)
        self._write(slots, ak.take(wi), d.take(wi), _score_of(new_score, wi))
        if step is None:
            prot[slots] = True
        res[wi] = slots
        return keys_idx[~won], ek, slots

    def _bucket_minima(self, buckets, prot):
        """(lowest score, its first lane) of each of ``buckets`` (None: all).

        Protected slots (``prot``: a bool array, or the step when protection
        is ``score == step``) count as ``INT64_MAX``, as in the generic round.
        """
        S = self.bucket_size
        sc = self.score.reshape(-1, S)
        if isinstance(prot, int):
            sc = sc.copy() if buckets is None else sc.take(buckets, axis=0)
            sc[sc == prot] = _INT64_MAX
        else:
            mask = prot.reshape(-1, S)
            if buckets is not None:
                sc, mask = sc.take(buckets, axis=0), mask.take(buckets, axis=0)
            sc = np.where(mask, _INT64_MAX, sc)
        pos = sc.argmin(axis=1)
        return np.take_along_axis(sc, pos[:, None], axis=1)[:, 0], pos

    @staticmethod
    def _first_claims(victim):
        """Mask of the earliest claim of each distinct slot in ``victim``.

        Sorts (slot, position) words: one plain sort, cheaper than the
        stable argsort behind ``np.unique(return_index=True)``.
        """
        n = int(victim.shape[0])
        sh = max(n - 1, 1).bit_length()
        if int(victim.max()).bit_length() + sh > 62:  # words would overflow
            won = np.zeros(n, dtype=bool)
            won[np.unique(victim, return_index=True)[1]] = True
            return won
        comp = np.left_shift(victim, sh)
        comp |= _iota(n)
        comp.sort()
        head = np.empty(n, dtype=bool)
        head[0] = True
        hi = comp >> sh
        np.not_equal(hi[1:], hi[:-1], out=head[1:])
        won = np.zeros(n, dtype=bool)
        won[comp[head] & ((1 << sh) - 1)] = True
        return won

    def _probe_rest(self, k, bb, ki, vals, rows):
        """Remaining digest candidates (false positives of the first one).

        ``bb`` is the chunk's (2, m) bucket pair; flat ``take``s keep the
        per-round overhead low (a chunk has only a few hundred such keys).
        """
        S = self.bucket_size
        shift, m = S.bit_length() - 1, int(k.shape[0])
        bbf = bb.reshape(-1)
        keys, one, s58 = self.keys, np.uint64(1), np.uint64(58)
        kk = k.take(ki)
        while True:
            low = ~vals
            low += one
            low &= vals
            pos = low * _DEBRUIJN
            pos >>= s58
            pos = _DEBRUIJN_TABLE.take(pos)
            sel = pos >> shift
            sel *= m
            sel += ki
            slot = bbf.take(sel)
            slot *= S
            pos &= S - 1
            slot += pos
            hit = keys.take(slot) == kk
            if hit.any():
                h = np.flatnonzero(hit)
                rows[ki.take(h)] = slot.take(h)
            vals ^= low
            keep = vals != 0
            np.greater(keep, hit, out=keep)
            if not keep.any():
                return
            keep = np.flatnonzero(keep)
            ki, vals, kk = ki.take(keep), vals.take(keep), kk.take(keep)
