"""Records loaded from a checkpoint (or given to `import_`) are validated
before use: a crafted or corrupt entry raises naming the layer, the entry
and its valid range, and the layer is left exactly as it was.

Each crafted record below was accepted before and then overflowed or
silently wrapped later (a training step, the sketch, Adam's bias
correction).
"""

import keras
import numpy as np
import pytest

from keras_sparse.table import HashTable
from keras_sparse.table import ShardedHashTable
from tests.test_hash_checkpoints import DIM
from tests.test_hash_checkpoints import NAME
from tests.test_hash_checkpoints import _assert_same_store
from tests.test_hash_checkpoints import _layer
from tests.test_hash_checkpoints import _model
from tests.test_hash_checkpoints import _populated
from tests.test_hash_checkpoints import _snapshot
from tests.test_hash_checkpoints import _store

I31 = 2**31 - 1  # sparse_iterations is int32, and the next step adds 1
# The seed generator's state dtype: uint32, int32 or int64 by backend.
SEED_BOUNDS = np.iinfo(keras.random.SeedGenerator(1).state.dtype)


def _with(store, name, other, value):
    """``value`` for an entry, with the paired entry ``name`` set to
    ``other`` (the saved layer has no pending admission keys)."""
    store[name] = np.array(other, np.int64)
    return np.array(value, np.int64)


def _scores(n, value):
    return np.full(n, value, np.int64)


# entry -> (crafted value from the saved store, message)
CASES = {
    "clock at int64 max": (
        lambda s: np.int64(2**63 - 1),
        "table_clock",
        r"`table_clock` must be in \[0, 2\*\*62\); received values from "
        r"9223372036854775807",
    ),
    "clock negative": (
        lambda s: np.int64(-1),
        "table_clock",
        r"`table_clock` must be in \[0, 2\*\*62\); received values from -1",
    ),
    "clock float": (
        lambda s: np.float64(3.5),
        "table_clock",
        r"`table_clock` must be an integer array of shape \(\) \(the LRU step",
    ),
    "clock not a scalar": (
        lambda s: np.zeros(2, np.int64),
        "table_clock",
        r"`table_clock` must be an integer array of shape \(\).*shape \(2,\)",
    ),
    "scores beyond the limit": (
        lambda s: _scores(len(s["record_keys"]), 2**62),
        "record_scores",
        r"`record_scores` must be in \[0, 2\*\*62\)",
    ),
    "iterations negative": (
        lambda s: np.int32(-1),
        "sparse_iterations",
        rf"`sparse_iterations` must be in \[0, {I31}\); received values from -1",
    ),
    "iterations without room": (
        lambda s: np.int64(I31),
        "sparse_iterations",
        rf"`sparse_iterations` must be in \[0, {I31}\)",
    ),
    "iterations float": (
        lambda s: np.float32(1.5),
        "sparse_iterations",
        r"`sparse_iterations` must be an integer array",
    ),
    "seed state float": (
        lambda s: np.asarray(s["seed_state"], np.float64),
        "seed_state",
        r"`seed_state` must be an integer array of shape \(2,\)",
    ),
    "seed state out of its dtype": (
        lambda s: np.array([int(SEED_BOUNDS.max) + 1, 0], np.uint64),
        "seed_state",
        rf"`seed_state` must be in \[{SEED_BOUNDS.min}, ",
    ),
    "admission counts negative": (
        lambda s: _with(s, "admission_keys", [7, 8], [1, -1]),
        "admission_sightings",
        r"`admission_sightings` must be in \[0, 2\*\*62\)",
    ),
    "admission counts float": (
        lambda s: np.asarray(s["admission_sightings"], np.float32),
        "admission_sightings",
        r"`admission_sightings` must be an integer array of shape \(\d+,\) "
        r"\(one count per admission key\)",
    ),
    "admission keys repeated": (
        lambda s: _with(s, "admission_sightings", [1, 1], [7, 7]),
        "admission_keys",
        r"`admission_keys` must be distinct",
    ),
    "capacity zero": (
        lambda s: np.int64(0),
        "table_capacity",
        r"`table_capacity` must be in \[1, 2\*\*62\)",
    ),
    "bucket size float": (
        lambda s: np.float64(16.0),
        "table_bucket_size",
        r"`table_bucket_size` must be an integer array",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_entry_is_refused_and_changes_nothing(case):
    craft, entry, match = CASES[case]
    store = _store(_populated(admit_after=2))
    store[entry] = craft(store)
    target = _layer(admit_after=2)
    target.import_([5, 6], np.ones((2, DIM)), scores=[2, 9])
    before = _snapshot(target)
    with pytest.raises(ValueError, match=f"Layer '{NAME}': {match}"):
        target.load_own_variables(store)
    _assert_same_store(_snapshot(target), before)


def test_the_highest_valid_clock_trains_on():
    store = _store(_populated())
    store["table_clock"] = np.int64(2**62 - 1)
    store["record_scores"] = _scores(len(store["record_keys"]), 2**62 - 1)
    target = _layer()
    model = _model(target)
    target.load_own_variables(store)
    x = np.array([[11, 99]] * 8, "int32")
    model.train_on_batch(x, np.zeros((8, DIM), "float32"))
    scores = dict(zip(*(target.export()[k].tolist() for k in ("keys", "scores"))))
    assert scores[11] == scores[99] == 2**62  # this step
    assert target._table_clock() == 2**62


def test_import_refuses_scores_beyond_the_limit():
    layer = _populated()
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=r"`scores` must be in \[0, 2\*\*62\)"):
        layer.import_([100], np.ones((1, DIM)), scores=[2**62])
    _assert_same_store(_snapshot(layer), before)


@pytest.mark.backend_independent
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bad", [-1, 2**62, 2**64 - 1])
def test_table_import_refuses_scores_out_of_range(sharded, bad):
    kw = dict(bucket_size=4, eviction="lfu", device="cpu")
    table = ShardedHashTable(96, 3, **kw) if sharded else HashTable(64, **kw)
    table.import_([1, 2], scores=[3, 4])
    before = [np.copy(a) for a in table.export()]
    dtype = np.uint64 if bad >= 2**63 else np.int64
    with pytest.raises(ValueError, match=r"scores must be in \[0, 2\*\*62\)"):
        table.import_([7, 8], scores=np.array([5, bad], dtype))
    for got, want in zip(table.export(), before):
        np.testing.assert_array_equal(got, want)


def _dense_layers():
    import keras_sparse as ks

    collection = ks.EmbeddingCollection(
        {"a": ks.TableConfig(5, 2)}, optimizer="adam", name="coll"
    )
    collection.build()
    dense = ks.layers.AllToAllDenseEmbedding(5, 2, optimizer="adam", name="dense")
    dense.build()
    return {"coll": collection, "dense": dense}


@pytest.mark.parametrize("kind", ["coll", "dense"])
@pytest.mark.parametrize("bad", [-1, I31])
def test_dense_layers_refuse_a_crafted_step_count(kind, bad):
    layer = _dense_layers()[kind]
    store = {}
    layer.save_own_variables(store)
    store = {k: np.asarray(v) + 1 for k, v in store.items()}  # all changed
    store["sparse_iterations"] = np.int64(bad)
    before = [np.copy(keras.ops.convert_to_numpy(v)) for v in layer.variables]
    with pytest.raises(
        ValueError,
        match=rf"Layer '{kind}': `sparse_iterations` must be in \[0, {I31}\)",
    ):
        layer.load_own_variables(store)
    for got, want in zip(layer.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), want)
