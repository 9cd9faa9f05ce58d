"""Placement and eviction of `ArrayTable`: where a call's new keys go.

A mixin of the bucketed table (`keras_sparse.table.array_table`): the
clock, the rows a call touches, claiming free or evictable slots in a
key's two candidate buckets round by round, and undoing a call's fills.
Written against the array namespace ``self.xp`` like the rest of the
algorithm; `NumpyTable` overrides the hot steps with fused NumPy code.
"""

from __future__ import annotations

from .call_results import BatchTooLargeError
from .call_results import TableFullError
from .call_results import score_of
from .undo import note_evicted
from .word_tricks import INT64_MAX


class ArrayPlacement:
    """Placement half of `ArrayTable` (see the module docstring)."""

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
        self._write(slots, ak[won], d[won], score_of(new_score, won))
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
            sc[sc == step] = INT64_MAX
        else:
            step = None
            sc[prot[cand]] = INT64_MAX
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
        self._write(slots, ak[wi], d[wi], score_of(new_score, wi))
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
