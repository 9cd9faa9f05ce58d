"""Undo records of ``lookup_or_insert`` calls: the table as it was before them.

A call asked for one (``lookup_or_insert_fresh(keys, undo=log)``) appends,
under the table's lock, what it overwrote: the clock, the scores of the rows
it found, the rows it gave to keys (free before, or taken from the evicted
keys, whose rows and scores are kept) and the counts it added to the
admission sketch. A call writes each row at most once (found and placed
rows are protected from the call's own evictions), so undoing records
newest first gives back exactly the keys, rows, scores, clock and sketch
counts before them. `state_before` computes that on copies, leaving the
table as it is: a prefetch stage maps batches ahead of training, and a
checkpoint must show the table as of the last trained batch.
"""

from __future__ import annotations

from typing import NamedTuple


class UndoRecord(NamedTuple):
    """What one ``lookup_or_insert`` call overwrote (arrays of the table's
    namespace)."""

    clock: int  # the clock before the call
    hit_rows: object  # rows of the keys found (duplicates allowed)
    hit_scores: object  # their scores before the call
    new_rows: object  # rows given to keys (free, or evicted below)
    evicted_keys: object
    evicted_rows: object
    evicted_scores: object
    sketch_keys: object  # keys counted by the admission sketch, or None
    sketch_counts: object  # their counts


class TableState(NamedTuple):
    """Live entries (row order), clock and sketch counters (or None)."""

    keys: object
    rows: object
    scores: object
    clock: int
    sketch_counts: object


def state_before(impl, records):
    """`TableState` of ``impl`` before the calls that wrote ``records``
    (given in call order); the table is not changed (the caller holds its
    lock)."""
    xp = impl.xp
    keys, score, clock = impl.keys.copy(), impl.score.copy(), impl.clock
    sketch = impl.sketch
    counts = None if sketch is None else sketch.counts.copy()
    for r in reversed(records):
        keys[r.new_rows] = impl._empty_keys(r.new_rows)
        score[r.new_rows] = 0
        keys[r.evicted_rows] = r.evicted_keys
        score[r.evicted_rows] = r.evicted_scores
        score[r.hit_rows] = r.hit_scores
        clock = r.clock
        if counts is not None and r.sketch_keys is not None:
            sketch.subtract(r.sketch_keys, r.sketch_counts, out=counts)
    live = keys != xp.repeat(impl.bucket_sentinel, impl.bucket_size)
    rows = xp.flatnonzero(live).astype(xp.int64)
    if counts is not None and hasattr(counts, "get"):
        counts = counts.get()
    return TableState(keys[rows], rows, score[rows], int(clock), counts)


def evicted_log(impl):
    """The list an undo-recording call collects its evictions in, or None."""
    return impl.__dict__.get("_evicted_log")


def note_evicted(impl, slots):
    """Keeps the keys and scores of ``slots`` before an eviction overwrites
    them (only while a call records its undo)."""
    log = evicted_log(impl)
    if log is not None:
        log.append((slots.copy(), impl.keys[slots], impl.score[slots]))
