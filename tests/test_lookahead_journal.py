"""A prefetch stage's undo journal recycles the arrays of dropped records."""

import numpy as np
import pytest

from keras_sparse.data.lookahead import Journal
from keras_sparse.data.lookahead import RecordBuffers
from keras_sparse.table import HashTable


def _snapshot(t):
    keys, rows, scores = t.export()
    return np.asarray(keys), np.asarray(rows), np.asarray(scores), t._impl.clock


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_recycled_records_give_back_each_earlier_table(eviction):
    # Batches mapped ahead; the journal keeps the last few batches' records
    # and hands the arrays of dropped ones to later calls. A save must still
    # see the table before any kept batch: snapshots are the reference.
    t = HashTable(64, eviction=eviction, device="cpu")
    buffers = RecordBuffers()
    journal = Journal(buffers)
    rng = np.random.default_rng(5)
    snapshots, dropped, reused = {}, set(), 0
    keep = 3
    for seq in range(20):
        snapshots[seq] = _snapshot(t)
        journal.seq = seq
        t.lookup_or_insert_fresh(rng.integers(0, 200, 48), undo=journal)
        record = journal._records[-1][1]
        reused += id(record.buffer) in dropped
        # Records are views of the lent array: rows then their old scores.
        assert record.hit_rows.base is record.buffer
        assert record.hit_scores.base is record.buffer
        old = [r for s, r in journal._records if s <= seq - keep]
        dropped |= {id(r.buffer) for r in old}
        journal.trim(seq - keep + 1)
    assert reused > 10 and t.stats()["evictions"] > 0
    for first in range(20 - keep, 20):  # ascending, as a fit's saves come
        got = t.state_before(lambda first=first: journal.since(first, "emb"))
        want = snapshots[first]
        for a, b in zip(want[:3], got[:3]):
            np.testing.assert_array_equal(a, b)
        assert want[3] == got.clock


def test_dropped_records_return_their_arrays():
    t = HashTable(64, device="cpu")
    buffers = RecordBuffers()
    journal = Journal(buffers)
    for seq in range(3):
        journal.seq = seq
        t.lookup_or_insert_fresh(np.arange(10 * seq, 10 * seq + 16), undo=journal)
    held = [r.buffer for _, r in journal._records]
    assert all(b is not None and b.shape[1] >= 16 for b in held)
    journal.release()
    assert not journal._records
    # The next call of the same size gets one of them back, not a new array.
    assert any(buffers.take(16) is b for b in held)
    # A plain list as the log: no lent arrays, plain copies.
    log = []
    t.lookup_or_insert_fresh(np.arange(8), undo=log)
    assert log[0].buffer is None and log[0].hit_rows.shape == (8,)
