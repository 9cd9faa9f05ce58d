"""The CPU twin of the hash table: `ArrayTable` on NumPy arrays.

`NumpyTable` replaces the generic probe and claim steps of
`keras_sparse.table.array_table` with fused, chunked NumPy code that gives
identical results.
"""

from __future__ import annotations

import numpy as np

from .array_table import ArrayTable
from .call_results import score_of
from .undo import note_evicted
from .word_tricks import DEBRUIJN
from .word_tricks import DEBRUIJN_TABLE
from .word_tricks import INT64_MAX
from .word_tricks import UINT

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
        mask_dt = UINT[S // 8]
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
            pos = low * DEBRUIJN
            pos >>= np.uint64(58)
            pos = DEBRUIJN_TABLE.take(pos)
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
            self._write(slot, ak.take(won), d.take(won), score_of(new_score, won))
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
        self._write(slots, ak.take(wi), d.take(wi), score_of(new_score, wi))
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
            sc[sc == prot] = INT64_MAX
        else:
            mask = prot.reshape(-1, S)
            if buckets is not None:
                sc, mask = sc.take(buckets, axis=0), mask.take(buckets, axis=0)
            sc = np.where(mask, INT64_MAX, sc)
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
            pos = low * DEBRUIJN
            pos >>= s58
            pos = DEBRUIJN_TABLE.take(pos)
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
