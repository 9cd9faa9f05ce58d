"""The row moves of a table with ``cache_rows``, between its cache and store.

A training call's mapping (`keras_sparse.layers.row_storage.dense_slots`)
records a plan: the positions that take a slot, their ids and the ids
evicted from those slots. The step that trains the batch carries the plan
out (`DenseMoves.move`, reached through `keras_sparse.layers.row_moves`):
every evicted id's row is written to the store from the slot's values and
optimizer slots as they are before the step, then the new ids' rows are
read from the store into their slots. Plans are carried out in the order
the calls made them, the order of the steps; a step whose fill positions
are not those of the oldest plan raises instead of moving the wrong rows.

A dense store holds every id, so a fill never misses and leaves the id's
stored row in place (the id's write-back overwrites it).

Where the step reaches the cache variables' buffers in place and the store
has its rows as one array per field (`in_place`), `assign_and_move` maps
the batch and carries out its moves in the same call, compiled
(`DenseSlots.assign_and_move`): no plan is queued.
"""

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from keras_sparse.layers.row_storage.move_failures import store_failures
from keras_sparse.layers.row_tier import VALUES


@dataclass(frozen=True)
class DensePlan:
    """One training call's moves: the flat positions ``at`` given a slot,
    their ``ids`` and the ids ``evicted`` from those slots (-1: empty)."""

    at: np.ndarray
    ids: np.ndarray
    evicted: np.ndarray


class DenseMoves:
    """The dense store under one cache, and its pending plans."""

    def __init__(self, label, store, slot_names):
        self.layer_name = label
        self.store = store
        self.slot_names = tuple(slot_names)
        self.plans = deque()
        # Stores serve one caller at a time; inference threads read too.
        self.lock = threading.RLock()
        # Read by `row_moves.read_stored` (ids need no restoring here).
        self.read_keys = None
        self.counts = {"fills": 0, "write_backs": 0, "store_hits": 0}

    def record(self, ids, fill, evicted):
        """Queues the plan of a training call: flat ``ids``, ``fill`` (the
        first position of each id given a slot) and the ``evicted`` ids
        of those slots, in position order."""
        at = np.flatnonzero(fill)
        plan = DensePlan(at, np.asarray(ids)[at].astype(np.int64), evicted)
        with self.lock:
            self.plans.append(plan)

    def in_place(self, cache):
        """Whether `assign_and_move` serves ``cache`` ``{"table" | slot
        name: (dtype, width)}`` of the cache variables: the map runs
        compiled and the store has row arrays of the same dtypes and
        widths."""
        arrays = getattr(self.store, "row_arrays", lambda: None)()
        if arrays is None:
            return False
        for name, (dtype, width) in cache.items():
            array = arrays.get(VALUES if name == "table" else name)
            if array is None or array.dtype != np.dtype(dtype):
                return False
            if array.ndim != 2 or array.shape[1] != width:
                return False
        return True

    def assign_and_move(self, slot_map, ids, use, slots, cache):
        """Maps training ids into int32 ``slots`` and moves their rows at
        once: ``cache`` the cache's row arrays ``{"table" | slot name}``,
        written in place (see the module)."""
        with self.lock:
            names = ["table"] + list(self.slot_names)
            arrays = self.store.row_arrays()
            store = [arrays[VALUES if name == "table" else name] for name in names]
            cached = [cache[name] for name in names]
            with store_failures(self.layer_name, "Rows"):
                fills, backs = slot_map.assign_and_move(ids, use, slots, cached, store)
            self.store.count_moves(fills, backs)
            self.counts["fills"] += fills
            self.counts["write_backs"] += backs

    def move(self, rows, fresh, before):
        """See `_move` (one caller at a time)."""
        with self.lock, store_failures(self.layer_name, "Rows"):
            return self._move(fresh, before)

    def _move(self, fresh, before):
        """Carries out the oldest plan in the step that trains its batch.

        ``fresh``: the step's fill flags; ``before``: ``{"table" | slot
        name: [n, width]}``, each position's row before this step's fills.
        Returns ``(filled, fills)``: the fill flags and the rows read
        ``{"table" | slot name: [n, width]}`` (zeros elsewhere).
        """
        fresh = np.asarray(fresh, bool).reshape(-1)
        at = np.flatnonzero(fresh)
        plan = self._pop(at)
        old = plan.evicted >= 0
        if old.any():
            pos = at[old]
            out = {VALUES: before["table"][pos]}
            out.update({name: before[name][pos] for name in self.slot_names})
            self.store.write(plan.evicted[old], out)
            self.counts["write_backs"] += int(pos.size)
        n = fresh.shape[0]
        fills = {
            name: np.zeros((n,) + value.shape[1:], value.dtype)
            for name, value in before.items()
        }
        if at.size:
            _, got = _read(self.store, plan.ids, (VALUES,) + self.slot_names)
            fills["table"][at] = got[VALUES]
            for name in self.slot_names:
                fills[name][at] = got[name]
            self.counts["fills"] += int(at.size)
        return fresh, fills

    def _pop(self, at):
        if not self.plans:
            raise RuntimeError(
                f"Layer '{self.layer_name}': a training step found no row moves "
                "to carry out for its batch (its ids were not mapped in "
                "training). Nothing was changed."
            )
        if not np.array_equal(at, self.plans[0].at):
            raise RuntimeError(
                f"Layer '{self.layer_name}': the step's fill positions are not "
                "those its batch's mapping gave out (a batch was mapped but "
                "never trained, or trained twice). The store was not "
                "changed; restore the model from a checkpoint."
            )
        return self.plans.popleft()

    def read_missing(self, keys, rows, dtype):
        """``(found, values)`` of a read-only call: where an id has no cache
        row (``rows`` -1; -2: unused) and its stored vector ``[n, dim]``."""
        with self.lock:
            missing = np.flatnonzero(np.asarray(rows).reshape(-1) == -1)
            width = next(f.width for f in self.store.fields if f.name == VALUES)
            found = np.zeros(keys.shape[0], bool)
            values = np.zeros((keys.shape[0], width), dtype)
            if missing.size:
                _, got = _read(self.store, keys[missing], (VALUES,))
                found[missing] = True
                values[missing] = got[VALUES]
                self.counts["store_hits"] += int(missing.size)
            return found, values

    def drop_plans(self):
        """Forgets the pending plans (their batches will not be trained)."""
        with self.lock:
            self.plans.clear()

    def pending(self):
        """How many training calls have not had their step yet."""
        with self.lock:
            return len(self.plans)

    def stats(self):
        out = dict(self.counts)
        out["store_size"] = int(self.store.size)
        out["store_bytes"] = int(self.store.nbytes)
        return out


def _read(store, ids, names):
    """``store.read(ids)``, only the fields ``names`` where the store can."""
    if hasattr(store, "read_fields"):
        return store.read_fields(ids, names)
    return store.read(ids)
