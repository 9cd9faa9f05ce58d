"""A hash layer's rows below the device: evicted keys kept in a row store.

With ``store=`` a `DistributedHashEmbedding`'s ``capacity`` rows on the
device are a cache. A key the table evicts is written back to the store
(vector, optimizer slots, score) and comes back with them when it is seen
again; it is admitted at sight, since it was admitted before. Training
equals training with a table large enough to hold every key, key by key.

Moves are decided where keys are mapped (the table call, on the host) and
carried out in the step that trains the batch, because only the step has
the rows' current values (an earlier step of the input stage's look-ahead
may still update them). Each training table call records a `MovePlan`; the
step that trains its batch pops it (`RowTier.move`): first every evicted
key is written back from the rows it left (their values before this step),
then every fresh row whose key the store holds is filled from it. The
key's stored copy stays (no erase on the step's path): while the key has
a row the table's copy wins, and its eviction's write-back overwrites the
stored one. Readers of the store therefore leave out the keys the table
holds (`keras_sparse.layers.stored_rows`, `RowTier.stored_size`); the
table asks `held` and read-only calls read the store only for keys
without a row. Plans are consumed in the order the calls made them, which
is the order of the steps, with or without `keras_sparse.data.prefetch`; a step
whose fresh rows are not those of the oldest plan raises instead of moving
the wrong rows.

Fresh rows the store does not fill are drawn per key (a function of the
layer seed and the key), so a key's first vector does not depend on which
other keys the store filled in the same batch.
"""

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from keras_sparse.layers.row_storage.move_failures import store_failures

#: Store field of a key's table score (LRU step or LFU count).
SCORE = "score"
#: Store field of a key's vector.
VALUES = "values"


@dataclass(frozen=True)
class MovePlan:
    """The row moves of one training table call (NumPy arrays).

    ``rows``: the rows the call gave to keys (distinct), ``keys`` their
    keys; ``victim_keys``/``victim_rows``/``victim_scores``: the keys the
    call evicted, the rows they left and their scores then.
    """

    rows: np.ndarray
    keys: np.ndarray
    victim_keys: np.ndarray
    victim_rows: np.ndarray
    victim_scores: np.ndarray


class RowTier:
    """The row store under one hash layer's table, and its pending moves."""

    def __init__(self, layer_name, store, slot_names):
        self.layer_name = layer_name
        self.store = store
        self.scored = any(f.name == SCORE for f in store.fields)
        self.slot_names = tuple(slot_names)
        self.plans = deque()
        # Stores serve one caller at a time; inference threads read too.
        self.lock = threading.RLock()
        # The whole keys of the last read-only table call (see row_moves).
        self.read_keys = None
        # ``() -> int64 keys`` the table holds (as of its last trained
        # step): their stored copies, if any, are stale (see `stored_size`).
        self.table_keys = None
        self.counts = {"fills": 0, "write_backs": 0, "store_hits": 0}

    # ------------------------------------------------------------- mapping
    def held(self, keys):
        """The table's `set_held_keys` hook: keys in the store, or evicted
        by a call whose step has not run yet (their write-back is pending)."""
        keys = np.asarray(keys, np.int64)
        # One look at the store and the plans: a step (another thread, with
        # the input stage) may write a plan's victims down in between.
        with self.lock:
            found, rows = _read(self.store, keys, (SCORE,))
            plans = list(self.plans)
        held = np.asarray(found, bool).copy()
        scores = np.asarray(rows[SCORE]).reshape(-1).astype(np.int64)
        for plan in plans:
            if plan.victim_keys.size:
                pos = positions(plan.victim_keys, keys)
                hit = pos >= 0
                held |= hit
                scores[hit] = plan.victim_scores[pos[hit]]
        return held, scores

    def record(self, mapped):
        """Queues the plan of a training table call: ``mapped``, its host
        `keras_sparse.layers.hash.key_mapper.MappedKeys` (flat NumPy keys,
        rows, fresh flags at first positions only, and evicted keys with
        their rows and scores)."""
        at = np.flatnonzero(mapped.fresh)
        plan = MovePlan(
            np.asarray(mapped.rows[at], np.int64),
            np.asarray(mapped.keys[at], np.int64),
            np.asarray(mapped.evicted_keys, np.int64),
            np.asarray(mapped.evicted_rows, np.int64),
            np.asarray(mapped.evicted_scores, np.int64),
        )
        with self.lock:
            self.plans.append(plan)

    # ---------------------------------------------------------------- step
    def move(self, rows, fresh, before):
        """See `_move` (one caller at a time)."""
        with self.lock, store_failures(self.layer_name, "Keys"):
            return self._move(rows, fresh, before)

    def _move(self, rows, fresh, before):
        """Carries out the oldest plan in the step that trains its batch.

        ``rows``/``fresh``: the step's flat rows and fresh flags;
        ``before``: ``{"table" | slot name: [n, width]}``, each position's
        row as it is before this step's fills. Returns ``(filled, fills)``:
        a bool ``[n]`` mask of the fresh positions filled from the store and
        their rows ``{"table" | slot name: [n, width]}`` (zeros elsewhere).
        """
        rows = np.asarray(rows).reshape(-1)
        fresh = np.asarray(fresh, bool).reshape(-1)
        plan = self._pop(rows, fresh)
        at = np.flatnonzero(fresh)
        if plan.victim_keys.size:
            pos = positions(rows[at], plan.victim_rows)
            if (pos < 0).any():
                raise RuntimeError(
                    f"Layer '{self.layer_name}': an evicted key's row is not "
                    "among the step's fresh rows; nothing was written back."
                )
            pos = at[pos]
            out = {VALUES: before["table"][pos]}
            out.update({name: before[name][pos] for name in self.slot_names})
            if self.scored:
                out[SCORE] = plan.victim_scores.reshape(-1, 1)
            self.store.write(plan.victim_keys, out)
            self.counts["write_backs"] += int(plan.victim_keys.size)
        n = rows.shape[0]
        filled = np.zeros(n, bool)
        fills = {
            name: np.zeros((n,) + before[name].shape[1:], before[name].dtype)
            for name in before
        }
        if plan.keys.size:
            keys = plan.keys[positions(plan.rows, rows[at])]
            names = (VALUES,) + self.slot_names
            found, got = _read(self.store, keys, names)
            found = np.asarray(found, bool)
            if found.any():
                hit = at[found]
                filled[hit] = True
                fills["table"][hit] = got[VALUES][found]
                for name in self.slot_names:
                    fills[name][hit] = got[name][found]
                # The stored copy stays: the table's wins while the key has a
                # row, and the key's write-back overwrites it.
                self.counts["fills"] += int(found.sum())
        return filled, fills

    def read_missing(self, keys, rows, dtype):
        """See `_read_missing` (one caller at a time)."""
        with self.lock:
            return self._read_missing(keys, rows, dtype)

    def _read_missing(self, keys, rows, dtype):
        """``(found, values)``: where a key has no row (``rows`` -1) but the
        store holds it, and its stored vector (``[n, dim]`` of ``dtype``)."""
        # -1: no row; padding (-2) is never read.
        missing = np.flatnonzero(np.asarray(rows).reshape(-1) == -1)
        width = next(f.width for f in self.store.fields if f.name == VALUES)
        found = np.zeros(keys.shape[0], bool)
        values = np.zeros((keys.shape[0], width), dtype)
        if missing.size:
            hit, got = _read(self.store, keys[missing], (VALUES,))
            hit = np.asarray(hit, bool)
            found[missing[hit]] = True
            values[missing[hit]] = got[VALUES][hit]
            self.counts["store_hits"] += int(hit.sum())
        return found, values

    def _pop(self, rows, fresh):
        if not self.plans:
            raise RuntimeError(
                f"Layer '{self.layer_name}': a training step found no row moves "
                "to carry out for its batch (its keys were not mapped by this "
                "layer's table in training). Nothing was changed."
            )
        plan = self.plans[0]
        step_rows = np.sort(rows[fresh].astype(np.int64))
        if not np.array_equal(step_rows, np.sort(plan.rows)):
            raise RuntimeError(
                f"Layer '{self.layer_name}': the step's fresh rows are not "
                "those its batch's table call gave out (a batch was mapped "
                "but never trained, or trained twice). The store was not "
                "changed; restore the model from a checkpoint."
            )
        return self.plans.popleft()

    def drop_plans(self):
        """Forgets the pending plans (their batches will not be trained)."""
        with self.lock:
            self.plans.clear()

    def pending(self):
        """How many training calls have not had their step yet."""
        with self.lock:
            return len(self.plans)

    def drop_newest(self, count):
        """Forgets the plans of the last ``count`` calls: the input stage
        undid them in the table, and their batches will not be trained."""
        with self.lock:
            for _ in range(min(count, len(self.plans))):
                self.plans.pop()

    def reset(self, records):
        """Empties the store and fills it with ``records`` (a checkpoint's
        keys that have no row in the table), dropping pending plans."""
        with self.lock:
            self._reset(records)

    def _reset(self, records):
        self.plans.clear()
        self.store.clear()
        if not len(records.keys):
            return
        out = {VALUES: records.values}
        out.update({name: records.slots[name] for name in self.slot_names})
        if records.scores is None:
            out[SCORE] = np.ones((len(records.keys), 1), np.int64)
        else:
            out[SCORE] = np.asarray(records.scores, np.int64).reshape(-1, 1)
        self.store.write(records.keys, out)

    def stored_size(self, table_keys=None):
        """How many keys the store holds that the table does not
        (``table_keys``: the table's keys, default `table_keys`): the
        stored copies of keys with a row are stale and not counted.

        Reads the table before taking the store's lock: a table call holds
        the table's lock while it asks the store (`held`), so the two locks
        are always taken in that order."""
        if table_keys is None and self.table_keys is not None:
            table_keys = self.table_keys()
        with self.lock:
            size = int(self.store.size)
            if table_keys is None or not size:
                return size
            keys = np.asarray(table_keys, np.int64).reshape(-1)
            return size - int(np.count_nonzero(self.store.contains(keys)))

    def stats(self):
        out = dict(self.counts)
        out["store_size"] = self.stored_size()
        out["store_bytes"] = int(self.store.nbytes)
        return out


def _read(store, keys, names):
    """``store.read(keys)``, only the fields ``names`` where the store can
    (its other fields are not gathered)."""
    if hasattr(store, "read_fields"):
        return store.read_fields(keys, names)
    return store.read(keys)


def positions(haystack, needles):
    """Index in ``haystack`` (distinct values) of each of ``needles``, -1
    where absent."""
    haystack = np.asarray(haystack)
    needles = np.asarray(needles)
    if haystack.size == 0:
        return np.full(needles.shape, -1, np.int64)
    order = np.argsort(haystack, kind="stable")
    ranked = haystack[order]
    i = np.minimum(np.searchsorted(ranked, needles), ranked.size - 1)
    return np.where(ranked[i] == needles, order[i], -1)


def check_not_shared(layer, table):
    """Raises when ``table`` would be shared by layers one of which has a
    row store: the table's evictions go down to one store (its hook), with
    values read from one layer's variables, so a sharer would lose keys."""
    from keras_sparse.layers.hash import table_users

    mine = getattr(layer, "store", None) is not None
    others = [
        u for u in table_users.users_of(table) if u is not layer and u.table is table
    ]
    below = getattr(table, "has_held_keys", False)
    if (mine and others) or (below and not mine) or (below and others):
        names = ", ".join(repr(u.name) for u in others) or "a layer with a store"
        raise ValueError(
            f"Layer '{layer.name}': its hash table would be shared with "
            f"{names}, and a layer with a row store (`store=`) cannot share "
            "its table: the keys one layer evicts would be written back from "
            "the other's rows, or lost. Give each layer its own table."
        )
