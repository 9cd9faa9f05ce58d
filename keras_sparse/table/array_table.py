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

"""

from __future__ import annotations

import numpy as np

from .admission import ExactCounts
from .array_placement import ArrayPlacement
from .call_results import InsertResult
from .keys import bucket_pair
from .keys import digest
from .keys import hash_keys
from .keys import seed_word
from .keys import to_host
from .undo import UndoRecord
from .undo import evicted_log
from .word_tricks import DEBRUIJN
from .word_tricks import DEBRUIJN_TABLE
from .word_tricks import UINT

MIN_BUCKETS = 4


class ArrayTable(ArrayPlacement):
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
        row_dt = UINT[min(S, 8)]
        dig_rows = self.digest.view(row_dt).reshape(self.num_buckets, -1)
        g = np.take(dig_rows, bb, axis=0).view(np.uint8).reshape(n, 2 * S)
        eq = g == d[:, None]
        packed = np.packbits(eq, axis=1, bitorder="little")
        wbytes = min(packed.shape[1], 8)
        words = packed.view(UINT[wbytes]).reshape(-1)
        nw = packed.shape[1] // wbytes
        flat_bb = bb.reshape(-1)
        shift = np.int64(S.bit_length() - 1)
        if nw == 1:
            # Dense first round over all keys (most keys have exactly one
            # candidate); only digest false positives go to the sparse rounds.
            vals = words.astype(np.uint64)
            low = vals & (~vals + np.uint64(1))
            pos = DEBRUIJN_TABLE[(low * DEBRUIJN) >> np.uint64(58)]
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
            pos = DEBRUIJN_TABLE[(low * DEBRUIJN) >> np.uint64(58)] + base
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
