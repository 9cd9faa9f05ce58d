"""Training batches' id -> cache row mappings, made ahead of their steps.

The input stage (`keras_sparse.data.prefetch`) hands each training batch
to Keras in order; for a table with ``cache_rows`` it first maps the
batch's ids (`AheadMaps.map`, on the stage's or the consumer's thread), so
that the step finds its mapping made and only moves rows. The mapping is
most of a cached step's host work, and it now overlaps the previous step.

Why this is exact without pinning the rows of batches in flight: a
mapping only decides; the row moves it implies (a victim's row written to
the store, the new id's row filled from it) run in the step that trains
its batch, in step order. A row that batch ``t`` hits and batch ``t + 1``'s
mapping evicts is written back in step ``t + 1``, after step ``t`` trained
it; an id evicted by ``t + 1`` and mapped again by ``t + 2`` is filled in
step ``t + 2``, after that write-back.

A step uses the oldest mapping only if it was made for exactly the step's
ids (`for_step`): otherwise (a batch fetched but never trained, another
caller, a mapping undone) every mapping made ahead is undone, newest
first, and the step maps its ids itself. Undoing puts each victim row's
former id back and forgets the new ids: no move has run for them, so
every row is where the map then says. Only the CLOCK bits keep the
undone mappings' traces, which changes which rows later batches evict,
never a value. Readers of the map that must see it as of the last
trained step (read-only lookups, saves, counts) read it with the
mappings made ahead undone in their answer only (`as_trained`,
`trained_id_of_slot`), so the mappings stay for their steps, e.g.
across a checkpoint taken mid-epoch; clearing the map undoes them
(`settle`).
"""

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AheadEntry:
    """One batch's mapping: its flat ``ids`` and ``use`` (None: every
    position), the int32 ``slots`` and bool ``fill`` flags it gave, and
    per new id (in order of first position) its ``fill_ids``, ``victims``
    (the rows) and the ids ``evicted`` from them (-1: empty row), int64.
    ``counts``: what it added to the map's hit, miss and eviction counts."""

    ids: np.ndarray
    use: object
    slots: np.ndarray
    fill: np.ndarray
    fill_ids: np.ndarray
    victims: np.ndarray
    evicted: np.ndarray
    counts: dict

    def matches(self, ids, use):
        if ids.shape != self.ids.shape or not np.array_equal(ids, self.ids):
            return False
        if self.use is None:
            return bool(use.all())
        return np.array_equal(use, self.use)


class AheadMaps:
    """The mappings made ahead for one `DenseSlots` map (see the module).

    ``slot_map.lock`` (re-entrant) orders every change of the map; the
    queue has a lock of its own, so a step whose mapping is ready takes it
    without waiting for a mapping being made for a later batch.
    """

    def __init__(self, slot_map):
        self._map = slot_map
        self._entries = deque()
        self._queue_lock = threading.Lock()
        self.counts = {"mapped_ahead": 0, "used_ahead": 0, "undone_ahead": 0}

    def __len__(self):
        return len(self._entries)

    def map(self, ids, use=None):
        """Maps a training batch's flat ``ids`` (where ``use``; None: all)
        after the batches mapped before it; raises as a step's mapping would,
        changing nothing."""
        ids = np.array(ids).reshape(-1)
        use = None if use is None else np.array(use, bool).reshape(-1)
        with self._map.lock:
            before = dict(self._map.counts)
            slots, fill, evicted = self._map.assign_now(
                ids, np.ones(ids.shape, bool) if use is None else use
            )
            at = np.flatnonzero(fill)
            counts = {k: self._map.counts[k] - before[k] for k in before}
            entry = AheadEntry(
                ids, use, slots, fill, ids[at].astype(np.int64),
                slots[at].astype(np.int64), np.asarray(evicted, np.int64), counts,
            )  # fmt: skip
            with self._queue_lock:
                self._entries.append(entry)
                self.counts["mapped_ahead"] += 1

    def for_step(self, ids, use, map_now):
        """``(entry, None)`` when the oldest mapping is ``ids``/``use``'s
        (taken off the queue), else ``(None, map_now())``: every mapping
        undone, then ``map_now`` run under the map's lock."""
        entry = self._take(ids, use)
        if entry is not None:
            return entry, None
        with self._map.lock:
            entry = self._take(ids, use)  # made while this step waited
            if entry is not None:
                return entry, None
            self._undo_all()
            return None, map_now()

    def settle(self):
        """Undoes every mapping made ahead (the map as of the last mapping
        a step used). Returns how many."""
        if not self._entries:
            return 0
        with self._map.lock:
            return self._undo_all()

    def pending(self):
        """What the mappings made ahead added to the map's counts."""
        out = dict.fromkeys(self._map.counts, 0)
        for entry in self._pending():
            for name, added in entry.counts.items():
                out[name] += added
        return out

    def trained_id_of_slot(self):
        """The map's id per row as of the last trained step, to read only:
        the map's own array when nothing is mapped ahead, else a copy with
        the mappings made ahead undone (caller holds the map's lock)."""
        entries = self._pending()
        if not entries:
            return self._map.id_of_slot
        id_of_slot = self._map.id_of_slot.copy()
        for entry in reversed(entries):
            id_of_slot[entry.victims] = entry.evicted
        return id_of_slot

    def as_trained(self, ids, slots):
        """Corrects ``slots``, the map's rows of ``ids`` now, to the rows as
        of the last trained step, in place (caller holds the map's lock):
        an id a mapping made ahead gave a row is not cached yet, one it
        evicted is still in its row."""
        entries = self._pending()
        if not entries:
            return
        undone = {}
        for entry in reversed(entries):
            undone.update(dict.fromkeys(entry.fill_ids.tolist(), -1))
            old = entry.evicted >= 0
            undone.update(zip(entry.evicted[old].tolist(), entry.victims[old].tolist()))
        keys = np.fromiter(undone, np.int64, len(undone))
        hit = np.flatnonzero(np.isin(ids, keys))
        for p in hit:
            slots[p] = undone[int(ids[p])]

    def _pending(self):
        with self._queue_lock:
            return list(self._entries)

    def _take(self, ids, use):
        with self._queue_lock:
            if self._entries and self._entries[0].matches(ids, use):
                self.counts["used_ahead"] += 1
                return self._entries.popleft()
        return None

    def _undo_all(self):
        """Caller holds the map's lock."""
        with self._queue_lock:
            entries = list(self._entries)
            self._entries.clear()
        for entry in reversed(entries):
            self._map.undo(entry)
        self.counts["undone_ahead"] += len(entries)
        return len(entries)


def one_mapper():
    """Whether a training step maps exactly the batch the input stage hands
    over: not where replicas or processes map the batch gathered from all
    of them (TensorFlow strategies of several replicas, torch.distributed
    processes, JAX processes of one distribution)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        from keras_sparse.layers.row_storage import cache_jax_processes

        return not cache_jax_processes.active()
    if backend == "tensorflow":
        import tensorflow as tf

        return (
            not tf.distribute.has_strategy()
            or tf.distribute.get_strategy().num_replicas_in_sync == 1
        )
    if backend == "torch":
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized())
    return False
