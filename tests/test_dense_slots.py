"""The host map and moves of a table with ``cache_rows``, against a dict.

`DenseSlots` (ids -> cache slots, CLOCK eviction) and `DenseMoves`
(write-backs, then fills, through a dense host store) run on random
batches with padding; the reference is a dict of the cached ids and a
whole table that every step adds 1 to, once per distinct id used.
No Keras step: pure NumPy, on any backend.
"""

import numpy as np
import pytest

from keras_sparse import store as row_stores
from keras_sparse.layers.row_storage.dense_moves import DenseMoves
from keras_sparse.layers.row_storage.dense_slots import DenseSlots

VOCAB, CACHE, N = 60, 12, 10


def _store(name):
    fields = (
        row_stores.FieldSpec("values", 2, "float32"),
        row_stores.FieldSpec("acc", 1, "float32"),
    )

    def init(first, end):
        ids = np.arange(first, end, dtype="float32")[:, None]
        return {"values": np.hstack([ids, -ids]), "acc": np.zeros_like(ids)}

    return row_stores.get("host").open_dense(fields, VOCAB, init, name=name)


def _full(slots, moves, device):
    """The whole table as the layer sees it: store rows, cached ones over."""
    _, table = moves.store.read(np.arange(VOCAB))
    ids, at = slots.cached()
    for name in table:
        table[name][ids] = device[name][at]
    return table


@pytest.mark.parametrize("seed", range(4))
def test_slots_and_moves_match_a_dict_and_a_whole_table(seed):
    rng = np.random.default_rng(seed)
    slots = DenseSlots("t", VOCAB, CACHE)
    moves = DenseMoves("t", _store(f"slots{seed}"), ["acc"])
    device = {"table": np.zeros((CACHE, 2), "f4"), "acc": np.zeros((CACHE, 1), "f4")}
    want = _full(slots, moves, {"values": device["table"], "acc": device["acc"]})
    cached = {}  # id -> slot
    hits = misses = evictions = 0
    for _ in range(40):
        # Skewed ids (repeats within a batch), some positions unused.
        ids = (rng.zipf(1.3, N) % VOCAB).astype("int64")
        use = rng.random(N) < 0.85
        if rng.random() < 0.1:  # more distinct ids than rows: refused
            big = rng.permutation(VOCAB)[: CACHE + 1]
            state = slots.slot_of_id.copy(), slots.id_of_slot.copy()
            with pytest.raises(RuntimeError, match="found no cache row"):
                slots.assign(big, np.ones(big.size, bool))
            np.testing.assert_array_equal(slots.slot_of_id, state[0])
            np.testing.assert_array_equal(slots.id_of_slot, state[1])
        got, fill, evicted = slots.assign(ids, use)
        moves.record(ids, fill, evicted)
        # The dict's view of the batch.
        used = ids[use]
        new = [i for i in dict.fromkeys(used.tolist()) if i not in cached]
        first = [int(np.flatnonzero(use & (ids == i))[0]) for i in new]
        np.testing.assert_array_equal(np.flatnonzero(fill), sorted(first))
        assert set(evicted[evicted >= 0].tolist()).isdisjoint(used.tolist())
        for gone in evicted[evicted >= 0].tolist():
            del cached[gone]
        for i in new:
            cached[i] = int(got[np.flatnonzero(use & (ids == i))[0]])
        assert np.all(got[~use] == -1)
        np.testing.assert_array_equal(got[use], [cached[i] for i in used.tolist()])
        assert len(set(cached.values())) == len(cached) <= CACHE
        mapped = np.full(VOCAB, -1)
        mapped[list(cached)] = list(cached.values())
        np.testing.assert_array_equal(slots.slot_of_id, mapped)
        hits += int(used.size) - len(new)
        misses += len(new)
        evictions += int((evicted >= 0).sum())
        # The step: moves (values before its fills), then +1 per distinct id.
        before = {name: v[np.maximum(got, 0)] for name, v in device.items()}
        filled, fills = moves.move(got, fill, before)
        for name, var in device.items():
            var[got[filled]] = fills[name][filled]
        for var in device.values():
            var[np.unique(got[use])] += 1
        for name in want:
            want[name][np.unique(used)] += 1
        table = _full(slots, moves, {"values": device["table"], "acc": device["acc"]})
        for name in want:
            np.testing.assert_array_equal(table[name], want[name])
        # Read-only lookups change nothing.
        probe = rng.integers(0, VOCAB, 7)
        np.testing.assert_array_equal(
            slots.lookup(probe, np.ones(7, bool)), mapped[probe]
        )
    assert slots.counts == {"hits": hits, "misses": misses, "evictions": evictions}
    assert moves.counts["fills"] == misses
    assert moves.counts["write_backs"] == evictions > 0
    assert moves.pending() == 0


def test_out_of_range_ids_raise_before_the_map_changes():
    slots = DenseSlots("t", VOCAB, CACHE)
    slots.assign(np.array([1, 2]), np.ones(2, bool))
    for bad in ([3, VOCAB], [-1, 3]):
        with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)"):
            slots.assign(np.array(bad), np.ones(2, bool))
    # An unused position's id is not checked.
    slots.assign(np.array([4, VOCAB]), np.array([True, False]))
    assert sorted(slots.cached()[0].tolist()) == [1, 2, 4]
