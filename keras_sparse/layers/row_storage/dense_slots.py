"""Which ids of a fixed vocabulary a device cache holds, and where.

The host map of a table with ``cache_rows`` (see
`keras_sparse.layers.dense_cache`): ``slot_of_id`` (int32 per id, -1: not
cached) and ``id_of_slot`` (int64 per cache row, -1: empty), so mapping a
batch is a few vectorized NumPy passes over the batch, whatever the table's
size. Eviction is CLOCK (second chance): a hand sweeps the slots, clearing
the reference bit of each slot it passes and taking the first slots whose
bit is clear and that the batch being mapped does not use; a hit sets its
slot's bit. A sweep costs O(misses) per step on average.

For a fixed vocabulary the policy only changes speed: every id's row is
either in the cache or in the store, and each move writes it down before
its slot is reused, so any victim keeps training exact.
"""

import threading

import numpy as np

from keras_sparse.layers.row_storage.ahead_maps import AheadMaps
from keras_sparse.ops import native_cache


class DenseSlots:
    """The id <-> cache row map of one table (see the module)."""

    def __init__(self, label, input_dim, cache_rows, native=True):
        # Errors read "Layer '{label}': ...".
        self.label = label
        self.input_dim = int(input_dim)
        self.capacity = int(cache_rows)
        self.slot_of_id = np.full(self.input_dim, -1, np.int32)
        self.id_of_slot = np.full(self.capacity, -1, np.int64)
        self.referenced = np.zeros(self.capacity, bool)
        # The step a slot was last used in: a batch's own slots are never
        # victims of its misses.
        self.used_in = np.zeros(self.capacity, np.int64)
        self.hand = 0
        self.calls = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0}
        self.native = native
        # Orders every change of the map (the input stage maps batches
        # ahead on its own thread: `ahead`).
        self.lock = threading.RLock()
        self.ahead = AheadMaps(self)

    def compiled(self):
        """The compiled helpers `assign` uses, or None (NumPy passes)."""
        return native_cache.library() if self.native else None

    @property
    def size(self):
        """Ids cached as of the last trained step (mappings made ahead
        left out)."""
        with self.lock:
            return int(np.count_nonzero(self.ahead.trained_id_of_slot() >= 0))

    def trained_counts(self):
        """`counts` as of the mappings steps used (those made ahead left
        out)."""
        with self.lock:
            pending = self.ahead.pending()
            return {k: v - pending[k] for k, v in self.counts.items()}

    def cached(self):
        """``(ids, slots)`` of the ids cached as of the last trained step,
        ids ascending (mappings made ahead read as undone, left in place)."""
        with self.lock:
            id_of_slot = self.ahead.trained_id_of_slot()
        slots = np.flatnonzero(id_of_slot >= 0)
        ids = id_of_slot[slots]
        order = np.argsort(ids)
        return ids[order], slots[order]

    def clear(self):
        """Empties the cache (the store then holds every id's row)."""
        self.ahead.settle()
        self.slot_of_id.fill(-1)
        self.id_of_slot.fill(-1)
        self.referenced.fill(False)
        self.hand = 0

    def check_range(self, ids):
        """Raises ValueError on ids (the used ones) outside
        ``[0, input_dim)``."""
        if not ids.size or (ids.min() >= 0 and ids.max() < self.input_dim):
            return
        bad = (ids < 0) | (ids >= self.input_dim)
        self._out_of_range(int(ids[bad][0]), int(bad.sum()))

    def _out_of_range(self, first, count):
        raise ValueError(
            f"Layer '{self.label}': id {first} is out of range; "
            f"valid ids are in [0, {self.input_dim}) (input_dim="
            f"{self.input_dim}). {count} id(s) out of range in "
            "this batch; the cache and its store were not changed."
        )

    def lookup(self, ids, use):
        """Int32 slots of flat ``ids`` (-1: not cached or not ``use``d);
        reads only."""
        ids = np.asarray(ids).reshape(-1)
        use = np.asarray(use, bool).reshape(-1)
        slots = np.full(ids.shape[0], -1, np.int32)
        at = np.flatnonzero(use)
        used = ids[at]
        self.check_range(used)
        with self.lock:
            found = self.slot_of_id[used]
            self.ahead.as_trained(used, found)
        slots[at] = found
        return slots

    def assign(self, ids, use):
        """Maps a training batch: gives each used id of flat ``ids`` a slot.

        Returns ``(slots, fill, victims)``: int32 ``[n]`` slots (-1 where
        not ``use``d), bool ``[n]`` True at the first position of each id
        given a slot now, and the int64 ids evicted from those slots (in
        the order of their positions; -1 for empty slots). Raises before
        changing anything when the batch's ids cannot all be cached. A
        mapping made ahead for these ids (`ahead`) is used as it is.
        """
        ids = np.asarray(ids).reshape(-1)
        use = np.asarray(use, bool).reshape(-1)
        entry, mapped = self.ahead.for_step(ids, use, lambda: self.assign_now(ids, use))
        if entry is None:
            return mapped
        return entry.slots.copy(), entry.fill.copy(), entry.evicted.copy()

    def assign_now(self, ids, use):
        """`assign`, mapping the ids now (after any mapping made ahead)."""
        with self.lock:
            return self._assign(np.asarray(ids).reshape(-1), use)

    def _assign(self, ids, use):
        use = np.asarray(use, bool).reshape(-1)
        lib = self.compiled()
        if lib is not None:
            n = ids.shape[0]
            slots, fill = np.empty(n, np.int32), np.empty(n, bool)
            count, scratch = self._assign_compiled(lib, ids, use, slots, fill)
            return slots, fill, scratch[3][:count].copy()
        n = ids.shape[0]
        every = bool(use.all())
        at = None if every else np.flatnonzero(use)
        batch = ids if every else ids[at]
        self.check_range(batch)
        slots = np.full(n, -1, np.int32)
        fill = np.zeros(n, bool)
        if not batch.size:
            return slots, fill, np.zeros(0, np.int64)
        found = self.slot_of_id[batch]
        miss = found < 0
        used = found[~miss]
        # Distinct missing ids, by first position (among the batch's).
        missing, first = np.unique(batch[miss], return_index=True)
        if missing.size > self.capacity - used.size:  # else room for sure
            self._check_room(missing.size, used, batch.size)
        self.calls += 1
        self.referenced[used] = True
        self.used_in[used] = self.calls
        self.counts["hits"] += int(batch.size - missing.size)
        self.counts["misses"] += int(missing.size)
        evicted = np.zeros(0, np.int64)
        if missing.size:
            order = np.argsort(first)
            missing, first = missing[order], first[order]
            victims = self._victims(missing.size)
            evicted = self.id_of_slot[victims]
            old = evicted >= 0
            self.slot_of_id[evicted[old]] = -1
            self.counts["evictions"] += int(old.sum())
            self.id_of_slot[victims] = missing
            self.slot_of_id[missing] = victims
            self.referenced[victims] = False
            self.used_in[victims] = self.calls
            where = np.flatnonzero(miss)
            found[where] = self.slot_of_id[batch[where]]
            where = where[first]
            fill[where if every else at[where]] = True
        slots[slice(None) if every else at] = found
        return slots, fill, evicted

    def assign_and_move(self, ids, use, slots, cache, store):
        """`assign` of a training batch, writing its int32 ``slots`` [n],
        and its moves carried out at once: each victim's row of every
        array of ``cache`` (the cache's row arrays, values then optimizer
        slots) written to the same array of ``store`` (the dense store's
        row arrays, row = id) at the evicted id, then the new id's stored
        row copied into it. Returns ``(fills, write_backs)``. Compiled
        only (`compiled` is not None)."""
        lib = self.compiled()
        ids = np.asarray(ids).reshape(-1)
        use = np.asarray(use, bool).reshape(-1)

        def now():
            with self.lock:
                return self._assign_compiled(lib, ids, use, slots, None)

        entry, mapped = self.ahead.for_step(ids, use, now)
        if entry is None:
            count, (_, fill_ids, victims, evicted) = mapped
        else:  # mapped ahead: the moves are left
            slots[...] = entry.slots
            count = entry.fill_ids.shape[0]
            fill_ids, victims, evicted = entry.fill_ids, entry.victims, entry.evicted
        if count:
            lib.move_rows(count, victims, evicted, fill_ids, cache, store)
        return count, int(np.count_nonzero(evicted[:count] >= 0))

    def _assign_compiled(self, lib, ids, use, slots, fill):
        """``(count, (fill_pos, fill_ids, victims, evicted))`` of
        `NativeCache.assign` on this map; raises as `assign` does."""
        if ids.dtype not in (np.int32, np.int64) or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(ids, np.int64)
        every = bool(use.all())
        use = None if every else np.ascontiguousarray(use)
        n = ids.shape[0]
        scratch = tuple(np.empty(n, np.int64) for _ in range(4))
        counts = self.counts
        state = np.array(
            [self.hand, self.calls, counts["hits"], counts["misses"],
             counts["evictions"], 0, 0], np.int64,
        )  # fmt: skip
        maps = (self.slot_of_id, self.id_of_slot, self.referenced, self.used_in)
        count = lib.assign(ids, use, self.input_dim, maps, state, slots, fill, scratch)
        if count == native_cache.OUT_OF_RANGE:
            self._out_of_range(
                int(state[native_cache.INFO]), int(state[native_cache.INFO2])
            )
        if count == native_cache.NO_ROOM:
            positions = n if use is None else int(np.count_nonzero(use))
            self._no_room(int(state[native_cache.INFO]), positions)
        if count < 0:
            raise MemoryError(f"Layer '{self.label}': no memory to map the batch")
        self.hand = int(state[native_cache.HAND])
        self.calls = int(state[native_cache.CALLS])
        counts["hits"] = int(state[native_cache.HITS])
        counts["misses"] = int(state[native_cache.MISSES])
        counts["evictions"] = int(state[native_cache.EVICTIONS])
        return int(count), scratch

    def undo(self, entry):
        """Undoes a mapping made ahead (an `AheadEntry`, the newest one
        not undone; caller holds ``lock``): its new ids leave their rows,
        which their former ids take back."""
        self.slot_of_id[entry.fill_ids] = -1
        self.id_of_slot[entry.victims] = entry.evicted
        old = entry.evicted >= 0
        self.slot_of_id[entry.evicted[old]] = entry.victims[old].astype(np.int32)
        for name, added in entry.counts.items():
            self.counts[name] -= added

    def _check_room(self, count, used, positions):
        """Raises unless ``count`` slots are left besides the batch's hits
        (slots ``used``), before anything changes."""
        free = self.capacity - np.unique(used).size
        if count > free:
            self._no_room(count - free, positions)

    def _no_room(self, short, positions):
        raise RuntimeError(
            f"Layer '{self.label}': {short} id(s) of this batch "
            f"found no cache row: its {positions} ids hold more distinct "
            f"ids than cache_rows={self.capacity}. Use a larger "
            "`cache_rows` or a smaller batch; the cache and its store "
            "were not changed."
        )

    def _victims(self, count):
        """``count`` slots the batch does not use, by the CLOCK sweep (room
        checked by `_check_room`)."""
        out = []
        while count:
            # A window of the next slots from the hand (wrapping around).
            width = min(self.capacity, max(2 * count, 64))
            window = (self.hand + np.arange(width)) % self.capacity
            takeable = ~self.referenced[window] & (self.used_in[window] != self.calls)
            picked = np.flatnonzero(takeable)[:count]
            # The hand passes every slot up to the last one taken (or the
            # whole window), clearing their bits: their second chance.
            swept = width if picked.size < count else int(picked[-1]) + 1
            self.referenced[window[:swept]] = False
            self.hand = int((self.hand + swept) % self.capacity)
            taken = window[picked]
            self.used_in[taken] = self.calls  # not picked twice
            out.append(taken)
            count -= picked.size
        return np.concatenate(out).astype(np.int32)
