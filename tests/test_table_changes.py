"""`HashTable(track_changes=True)`: change steps and removed keys, against a
dict model of the table's records (property test).

Each record is (row, score, write): ``write`` numbers the last call that
wrote the key's row (a stand-in for its vector). For every earlier step
``s``, the records of that step updated by the delta since ``s`` (the keys
whose change step is after ``s``, with their current records; the removed
keys after ``s``) must equal the current records.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_sparse.table import HashTable
from keras_sparse.table import ShardedHashTable
from keras_sparse.table import change_keys

pytestmark = pytest.mark.backend_independent

keys_ = st.lists(st.integers(0, 60), min_size=1, max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("train"), keys_),
        st.tuples(st.just("erase"), keys_),
        st.tuples(st.just("import"), keys_),
        st.tuples(st.just("clear"), st.just([])),
    ),
    min_size=1,
    max_size=25,
)


def _records(table, writes):
    keys, rows, scores = (np.asarray(x) for x in table.export())
    return {
        int(k): (int(r), int(s), writes[int(k)]) for k, r, s in zip(keys, rows, scores)
    }


def _delta(table, since):
    rec = _records(table, _records.writes)
    keys = np.array(sorted(rec), np.int64)
    changed = change_keys.keys_changed(table, keys)
    gone, steps = change_keys.removed_keys(table)
    removed = {int(k) for k, s in zip(gone, steps) if s > since} - set(rec)
    return {int(k): rec[int(k)] for k, c in zip(keys, changed) if c > since}, removed


def _run(table, program):
    writes = _records.writes = {}
    snapshots = []  # (step, records) after each call
    for n, (op, keys) in enumerate(program):
        k = np.asarray(keys, np.int64)
        if op == "train":
            res = table.lookup_or_insert(k)
            for key, row in zip(keys, np.asarray(res.rows).ravel()):
                if row >= 0:
                    writes[key] = n
        elif op == "erase":
            table.erase(k)
        elif op == "clear":
            table.clear()
        else:
            live = set(np.asarray(table.export()[0]).tolist())
            new = np.unique([x for x in keys if x not in live]).astype(np.int64)
            if new.size:
                res = table.import_(new)
                for key, row in zip(new.tolist(), np.asarray(res.rows)):
                    if row >= 0:
                        writes[key] = n
        snapshots.append((table._impl.clock, _records(table, writes)))
    now = _records(table, writes)
    for step, before in snapshots:
        changed, removed = _delta(table, step)
        applied = {k: v for k, v in before.items() if k not in removed}
        applied.update(changed)
        assert applied == now, (step, program)
    return table


@settings(max_examples=50, deadline=None)
@given(ops, st.sampled_from(["lru", "lfu"]), st.sampled_from([None, 2]))
def test_deltas_since_any_step_rebuild_the_table(program, eviction, ttl):
    table = HashTable(
        16,
        bucket_size=4,
        eviction=eviction,
        device="cpu",
        ttl_steps=ttl,
        track_changes=True,
    )
    _run(table, program)


@settings(max_examples=20, deadline=None)
@given(ops)
def test_sharded_tables_track_changes_per_shard(program):
    table = ShardedHashTable(32, 4, bucket_size=4, ttl_steps=2, track_changes=True)
    assert table.track_changes and change_keys.tracks_changes(table)
    _run(table, program)


def test_untracked_tables_keep_no_change_steps():
    table = HashTable(16, device="cpu")
    assert not table.track_changes and not change_keys.tracks_changes(table)
    assert table._impl.changes is None
