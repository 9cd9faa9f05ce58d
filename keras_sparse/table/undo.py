"""Undo records of ``lookup_or_insert`` calls: the table as it was before them.

A call asked for one (``lookup_or_insert_fresh(keys, undo=log)``) appends,
under the table's lock, what it overwrote: the clock, the scores of the rows
it found, the rows it gave to keys (free before, or taken from the evicted
keys, whose rows and scores are kept) and the admission counts it changed
(`keras_sparse.table.admission.CountRecord`). A call writes each row at
most once (found and placed rows are protected from the call's own
evictions), so undoing records newest first gives back exactly the keys,
rows, scores, clock and admission counts before them. `state_before`
computes that on copies, leaving the table as it is: a prefetch stage maps
batches ahead of training, and a checkpoint must show the table as of the
last trained batch.

A log may lend the arrays for the found rows and their scores: with a
method ``buffer(n)`` returning an int64 ``[2, m]`` NumPy array, ``m >= n``,
which no record in use holds (a prefetch stage recycles those of dropped
records: each call's record is about two int64 per key, and new memory
costs a page fault per 4 KiB).
"""

from __future__ import annotations

from typing import NamedTuple

from .admission import counts_before


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
    admission: object  # CountRecord of the admission counts, or None
    # The array ``hit_rows`` and ``hit_scores`` are views of when the log
    # lent it (``log.buffer``), else None: given back once the record is
    # dropped, for a later call to fill.
    buffer: object = None
    ttl: object = None  # `keras_sparse.table.ttl.TtlRecord` (time to live)


class TableState(NamedTuple):
    """Live entries (row order), clock and pending admission counts
    (``(keys, counts)`` NumPy arrays, or None without admission)."""

    keys: object
    rows: object
    scores: object
    clock: int
    admission: object
    last_seen: object = None  # per key, with a time to live (`ttl`)


def state_before(impl, records):
    """`TableState` of ``impl`` before the calls that wrote ``records``
    (given in call order); the table is not changed (the caller holds its
    lock)."""
    xp = impl.xp
    keys, score, clock = impl.keys.copy(), impl.score.copy(), impl.clock
    ttl = getattr(impl, "ttl", None)
    seen = None if ttl is None else ttl.last_seen.copy()
    for r in reversed(records):
        keys[r.new_rows] = impl._empty_keys(r.new_rows)
        score[r.new_rows] = 0
        keys[r.evicted_rows] = r.evicted_keys
        score[r.evicted_rows] = r.evicted_scores
        score[r.hit_rows] = r.hit_scores
        if r.ttl is not None:  # after the placements: expired rows reused
            r.ttl.undo(keys, score, seen)
        clock = r.clock
    live = keys != xp.repeat(impl.bucket_sentinel, impl.bucket_size)
    rows = xp.flatnonzero(live).astype(xp.int64)
    pending = None
    if impl.admission is not None:
        pending = counts_before(impl.admission.state(), [r.admission for r in records])
    return TableState(
        keys[rows],
        rows,
        score[rows],
        int(clock),
        pending,
        None if seen is None else seen[rows],
    )


def evicted_log(impl):
    """The list an undo-recording call collects its evictions in, or None."""
    return impl.__dict__.get("_evicted_log")


def note_evicted(impl, slots):
    """Keeps the keys and scores of ``slots`` before an eviction overwrites
    them (only while a call records its undo)."""
    log = evicted_log(impl)
    if log is not None:
        log.append((slots.copy(), impl.keys[slots], impl.score[slots]))


def restore(impl, state):
    """Makes ``impl`` hold exactly ``state``, a `TableState` it gave (the
    caller holds its lock): every key at its row with its score, the clock
    and the pending admission counts. The hit/miss counters are kept: they
    count the calls made."""
    counters = dict(impl.counters)
    above = impl.__dict__.get("_score_above_clock", False)
    impl.clear()
    impl.clock = int(state.clock)
    if int(state.keys.shape[0]):
        impl.import_(state.keys, state.rows, state.scores)
    ttl = getattr(impl, "ttl", None)
    if ttl is not None:
        ttl.clear()
        seen = state.last_seen
        ttl.load(state.rows, impl.clock if seen is None else seen)
    impl.counters.update(counters)
    impl._score_above_clock = above
    if impl.admission is not None and state.admission is not None:
        impl.admission.load_state(*state.admission)
