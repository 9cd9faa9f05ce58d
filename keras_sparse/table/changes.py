"""Change tracking (``track_changes=True``): what changed after a step.

A `HashTable` built with ``track_changes=True`` keeps, for delta exports:

- each row's *change step*: the step of the last call that may have
  changed its key's record (int64 per row, on the table's device). A
  ``lookup_or_insert`` call at step ``s`` marks every row it returns (their
  scores move, and a training step updates their vectors); ``import_`` and
  the other calls made between training steps mark the rows they write
  with the next step (``clock + 1``), so that a delta taken at the current
  clock and the one after it agree on which side of the line they fall;
- the *removed keys*: each key evicted, expired (``ttl_steps``), erased or
  cleared, with the step of its last removal (host NumPy, compacted to one
  entry per key: 16 bytes per distinct removed key). A key held again keeps
  its entry: an input stage may have mapped it back ahead of training,
  while a delta as of the last trained step must still remove it.

Marks only ever err on the side of "changed": a call undone by an input
stage (`HashTable.undo_calls`) leaves its marks. A delta holding a key that
did not change holds its current record, which is harmless.

Cost: one scatter of the call's rows per call, plus the keys it removed.
The fused GPU path (`HashTable.step_rows`) is not taken by such a table (it
cannot report evicted keys without a host sync).
"""

from __future__ import annotations

import numpy as np

from .keys import to_host

NEVER = -1  # change step of a free row
# Removed-key chunks are compacted once they hold this many entries more
# than the last compaction kept (amortized: O(1) per removal).
_COMPACT_AFTER = 1 << 16


class Changes:
    """Change steps of a table's rows and its removed keys (``impl``: its
    `ArrayTable`)."""

    def __init__(self, impl):
        xp = impl.xp
        self.steps = xp.full(impl.capacity, NEVER, dtype=xp.int64)
        self._removed = []  # (keys, steps) host chunks, oldest first
        self._pending = 0
        self._kept = 0
        # Removals before this step are unknown (a table loaded from records
        # without its removal log): deltas since an earlier step are refused.
        self.horizon = 0

    def mark(self, rows, step):
        """Marks flat ``rows`` (-1 skipped) changed at ``step``."""
        rows = rows.reshape(-1)
        self.steps[rows[rows >= 0]] = int(step)

    def removed(self, impl, keys, step):
        """Records ``keys`` (this table's array namespace) removed at
        ``step``."""
        keys = to_host(keys).astype(np.int64, copy=False).reshape(-1)
        if not keys.size:
            return
        self._removed.append((keys, np.full(keys.size, int(step), np.int64)))
        self._pending += keys.size
        if self._pending > self._kept + _COMPACT_AFTER:
            self.compact(impl)

    def compact(self, impl):
        """One entry per removed key (its last removal); returns ``(keys,
        steps)`` sorted by key."""
        if not self._removed:
            empty = np.zeros(0, np.int64)
            return empty, empty
        keys = np.concatenate([k for k, _ in self._removed])
        steps = np.concatenate([s for _, s in self._removed])
        # Last removal per key: sort by (key, step), keep each key's last.
        order = np.lexsort((steps, keys))
        keys, steps = keys[order], steps[order]
        last = np.ones(keys.size, bool)
        last[:-1] = keys[1:] != keys[:-1]
        keys, steps = keys[last], steps[last]
        self._removed = [(keys, steps)]
        self._pending = self._kept = keys.size
        return keys, steps

    def forget_through(self, impl, step):
        """Drops the removals at or before ``step``: deltas since ``step``
        or later stay exact, earlier ones are refused (the horizon moves to
        ``step``). Returns how many entries were dropped."""
        keys, steps = self.compact(impl)
        keep = steps > step
        self._removed = [(keys[keep], steps[keep])] if keep.any() else []
        self._pending = self._kept = int(keep.sum())
        self.horizon = max(self.horizon, int(step))
        return int(keys.size - self._kept)

    def load(self, keys, steps, horizon):
        """Replaces the removal log (sorted or not) and its horizon."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        steps = np.asarray(steps, np.int64).reshape(-1)
        self._removed = [(keys, steps)] if keys.size else []
        self._pending = self._kept = keys.size
        self.horizon = int(horizon)

    def clear(self):
        self.steps.fill(NEVER)


def call_step(impl, step):
    """The step a ``lookup_or_insert`` call records (as `ArrayTable`'s)."""
    return impl.clock + 1 if step is None else int(step)


def after_call(impl, res, at, expired=None):
    """Records a call's marks and removals (``at``: its step)."""
    changes = getattr(impl, "changes", None)
    if changes is None:
        return
    if expired is not None:
        changes.removed(impl, expired, at)
    changes.removed(impl, res.evicted_keys, at)
    changes.mark(res.rows, at)
