"""Time to live: keys not seen for ``ttl_steps`` training steps expire.

A `HashTable` built with ``ttl_steps=N`` keeps each row's *last-seen step*:
the step of the last ``lookup_or_insert`` call (a training step) that gave
the row's key. The array is separate from the eviction scores (an LFU score
is a count; LRU keeps its own), int64, 8 bytes a row, on the table's device.

Seen: a ``lookup_or_insert`` call marks every row it returns with its step;
``lookup`` (inference, a frozen layer) marks nothing, as it changes no LRU
score. Keys a call does not admit (``admit_after``) have no row to mark.

Expiry: a call at step ``s`` (the clock plus one, or its ``step``) first
erases every key whose last-seen step is below ``s - N``, then maps its
keys. So a key seen at step ``t`` is still there at step ``t + N`` and gone
from step ``t + N + 1`` (unless seen again). A freed row is free for the
keys of that same call, and a key given it starts like any new key
(``fresh``: a new vector and reset optimizer slots in a layer). Expiry
depends only on each key's own steps and the clock the call sees, so it is
the same for any batch split, shard count or device, and an input stage
that maps batches ahead (`keras_sparse.data.prefetch`) expires exactly what
unstaged training does: its undo records (`keras_sparse.table.undo`) keep
the expired keys, so a read or save mid-stage shows them as of the last
trained step, and batches the stage mapped but abandoned untrained are
undone (`HashTable.undo_calls`: clock, last-seen steps, expired keys and
the ``expired`` count). A call that raises (a full table with
``eviction=None``) puts the expired keys back: a refused call changes
nothing. Pending admission counts do not expire.

Cost: one comparison per row in a call where some key may have expired (a
lower bound on the live rows' last-seen steps skips the others).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NEVER = np.iinfo(np.int64).max  # last-seen step of a free row: never expires


def check_ttl_steps(ttl_steps):
    """Raises ValueError unless ``ttl_steps`` is None or an int >= 1."""
    if ttl_steps is None:
        return
    if (
        isinstance(ttl_steps, bool)
        or not isinstance(ttl_steps, (int, np.integer))
        or ttl_steps < 1
    ):
        raise ValueError(
            "ttl_steps must be None (keys never expire) or an int >= 1 (the "
            f"training steps a key may go unseen), got {ttl_steps!r}"
        )


class TtlRecord(NamedTuple):
    """What a call's expiry and marks overwrote (for undo records)."""

    expired_keys: object
    expired_rows: object
    expired_scores: object
    expired_seen: object  # their last-seen steps
    seen_rows: object  # rows the call marked
    seen_before: object  # their last-seen steps before the call

    def undo(self, keys, score, last_seen):
        """Puts copies ``keys``/``score``/``last_seen`` back to before the
        call, after the call's own placements were undone."""
        last_seen[self.seen_rows] = self.seen_before
        keys[self.expired_rows] = self.expired_keys
        score[self.expired_rows] = self.expired_scores
        last_seen[self.expired_rows] = self.expired_seen


class Expiry:
    """Last-seen steps of a table's rows (``impl``: its `ArrayTable`)."""

    def __init__(self, steps, impl):
        xp = impl.xp
        self.steps = int(steps)
        self.last_seen = xp.full(impl.capacity, NEVER, dtype=xp.int64)
        # No live row was last seen before `floor`: calls whose limit is not
        # above it have nothing to expire and skip the scan.
        self.floor = 0
        self.expired = 0  # keys expired (stats()["expired"])

    def call_step(self, impl, step):
        """The step a ``lookup_or_insert`` call will record (see
        `ArrayTable._next_step`)."""
        return impl.clock + 1 if step is None else int(step)

    def expire(self, impl, step):
        """Erases the keys a call at ``step`` finds expired; their
        ``(keys, rows, scores, last_seen)`` (None when none)."""
        limit = step - self.steps
        if limit <= self.floor:
            return None
        xp = impl.xp
        rows = xp.flatnonzero(self.last_seen < limit)
        self.floor = limit
        if not int(rows.shape[0]):
            return None
        gone = (impl.keys[rows], rows, impl.score[rows], self.last_seen[rows])
        impl.erase(gone[0])
        self.last_seen[rows] = NEVER
        return gone

    def put_back(self, impl, gone):
        """Undoes `expire` (a call that raised); counters stay."""
        if gone is None:
            return
        counters = dict(impl.counters)
        above = impl.__dict__.get("_score_above_clock", False)
        impl.import_(gone[0], gone[1], gone[2])
        impl.counters.update(counters)
        impl._score_above_clock = above
        self.last_seen[gone[1]] = gone[3]
        self.floor = min(self.floor, int(gone[3].min()))

    def mark(self, rows, step, keep=False):
        """Marks ``rows`` (flat, -1 ignored) seen at ``step``; with
        ``keep``, returns ``(rows, last_seen before)`` for undo."""
        rows = rows.reshape(-1)
        rows = rows[rows >= 0]
        before = self.last_seen[rows] if keep else None
        self.last_seen[rows] = step
        self.floor = min(self.floor, int(step))
        return rows, before

    def clear(self):
        self.last_seen.fill(NEVER)

    def freed(self, rows):
        """Rows erased by other means (``erase``; -1 skipped)."""
        self.last_seen[rows[rows >= 0]] = NEVER

    def load(self, rows, steps):
        """Sets the last-seen steps of ``rows`` (after an import): ``steps``
        one int for all, or one per row; rows -1 are skipped."""
        rows = rows.reshape(-1)
        ok = rows >= 0
        rows = rows[ok]
        if not int(rows.shape[0]):
            return
        if isinstance(steps, (int, np.integer)):
            self.last_seen[rows] = int(steps)
            low = int(steps)
        else:
            steps = steps.reshape(-1)[ok]
            self.last_seen[rows] = steps
            low = int(steps.min())
        self.floor = min(self.floor, low)


class _Catch:
    """Takes a call's `UndoRecord` (to add the expiry before passing it
    on); lends the real log's buffers."""

    def __init__(self, log):
        self.log = log
        self.record = None

    def append(self, record):
        self.record = record

    def __getattr__(self, name):
        if name == "buffer":
            return self.log.buffer
        raise AttributeError(name)


def mapped(impl, k, step, undo):
    """``impl.lookup_or_insert_fresh(k, step, undo)`` of a table with a
    time to live: expiry first, marks after; the `UndoRecord` given to
    ``undo`` carries a `TtlRecord`. Returns ``(result, fresh, expired
    keys or None)``."""
    ttl = impl.ttl
    at = ttl.call_step(impl, step)
    gone = ttl.expire(impl, at)
    catch = None if undo is None else _Catch(undo)
    try:
        if catch is None:
            res, fresh = impl.lookup_or_insert_fresh(k, step)
        else:
            res, fresh = impl.lookup_or_insert_fresh(k, step, catch)
    except BaseException:
        ttl.put_back(impl, gone)
        raise
    seen_rows, before = ttl.mark(res.rows, at, keep=catch is not None)
    n_gone = 0 if gone is None else int(gone[0].shape[0])
    ttl.expired += n_gone
    expired_keys = None if gone is None else gone[0]
    if catch is not None:
        xp = impl.xp
        if gone is None:
            empty = xp.zeros(0, dtype=xp.int64)
            gone = (empty, empty, empty, empty)
        catch.record = catch.record._replace(ttl=TtlRecord(*gone, seen_rows, before))
        undo.append(catch.record)
    return res, fresh, expired_keys
