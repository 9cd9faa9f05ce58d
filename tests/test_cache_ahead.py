"""Mappings of a ``cache_rows`` table made ahead of their steps.

The input stage maps each training batch's ids to cache rows before
handing the batch over (`keras_sparse.layers.row_storage.ahead_maps`);
steps only move rows. Exactness is checked against a model of the table
that no cache stands between (a NumPy array updated in place), under
random interleavings of mappings made ahead, batches mapped ahead but
never trained, steps, read-only lookups and settling; then end to end
through `ks.data.prefetch` against the same model trained without the
stage (a checkpoint mid-epoch included).
"""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_sparse as ks
from keras_sparse.layers.row_storage.dense_slots import DenseSlots
from keras_sparse.ops import native_cache

VOCAB, CACHE = 40, 8

_ROUTES = ["numpy", "compiled-assign", "compiled-hop"]


def _route_or_skip(route):
    if route != "numpy" and native_cache.library() is None:
        pytest.skip(native_cache.status())
    return DenseSlots("t", VOCAB, CACHE, native=route != "numpy")


class _Table:
    """A cache of one float per row over a store, trained by adding to the
    rows a batch uses; `reference` is the same table without the cache."""

    def __init__(self, slot_map, route):
        self.map = slot_map
        self.route = route
        self.cache = np.zeros((CACHE, 1))
        self.store = np.arange(VOCAB, dtype=float)[:, None]
        self.reference = np.arange(VOCAB, dtype=float)

    def step(self, ids):
        use = np.ones(ids.shape, bool)
        if self.route == "compiled-hop":
            slots = np.empty(ids.shape, np.int32)
            self.map.assign_and_move(ids, use, slots, [self.cache], [self.store])
        else:
            slots, fill, evicted = self.map.assign(ids, use)
            at = np.flatnonzero(fill)
            victims = slots[at]
            old = evicted >= 0
            self.store[evicted[old]] = self.cache[victims[old]]
            self.cache[victims] = self.store[ids[at]]
        for p, (i, s) in enumerate(zip(ids, slots)):  # a position's update
            self.cache[s, 0] += p + 1
            self.reference[i] += p + 1

    def read(self, ids):
        slots = self.map.lookup(ids, np.ones(ids.shape, bool))
        return np.where(slots >= 0, self.cache[slots, 0], self.store[ids, 0])

    def whole(self):
        out = self.store[:, 0].copy()
        ids, slots = self.map.cached()
        out[ids] = self.cache[slots, 0]
        return out


_batch = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
_op = st.one_of(
    st.tuples(st.just("ahead"), st.integers(0, 3)),  # map the next n ahead
    st.tuples(st.just("stray"), _batch),  # mapped ahead, never trained
    st.tuples(st.just("step"), st.just(0)),
    st.tuples(st.just("read"), _batch),
    st.tuples(st.just("save"), st.just(0)),
    st.tuples(st.just("settle"), st.just(0)),
)


@pytest.mark.backend_independent
@pytest.mark.parametrize("route", _ROUTES)
@settings(max_examples=60, deadline=None)
@given(batches=st.lists(_batch, min_size=1, max_size=12), ops=st.lists(_op))
def test_mappings_made_ahead_keep_every_row_exact(route, batches, ops):
    table = _Table(_route_or_skip(route), route)
    batches = [np.array(b, np.int64) for b in batches]
    trained = mapped = 0  # batches trained, batches mapped ahead (in order)
    for kind, arg in ops + [("step", 0)] * len(batches):
        if kind == "ahead":
            for _ in range(arg):
                if mapped < len(batches):
                    table.map.ahead.map(batches[mapped])
                    mapped += 1
        elif kind == "stray":
            table.map.ahead.map(np.array(arg, np.int64))
            mapped = trained  # every later batch is mapped in its step
        elif kind == "step" and trained < len(batches):
            table.step(batches[trained])
            trained += 1
            mapped = max(mapped, trained)
        elif kind == "read":  # mappings made ahead stay for their steps
            ids = np.array(arg, np.int64)
            np.testing.assert_array_equal(table.read(ids), table.reference[ids])
        elif kind == "save":
            np.testing.assert_array_equal(table.whole(), table.reference)
        elif kind == "settle":
            table.map.ahead.settle()
            mapped = trained
    np.testing.assert_array_equal(table.whole(), table.reference)
    assert table.map.size <= CACHE


@pytest.mark.backend_independent
def test_a_mapping_made_ahead_is_used_by_its_step_and_left_out_of_counts():
    table = _Table(DenseSlots("t", VOCAB, CACHE), "numpy")
    first, second = np.array([1, 2, 3]), np.array([3, 4, 5, 6])
    table.map.ahead.map(first)
    table.map.ahead.map(second)
    assert table.map.size == 0  # nothing trained yet
    assert table.map.trained_counts() == {"hits": 0, "misses": 0, "evictions": 0}
    table.step(first)
    assert table.map.size == 3
    assert table.map.trained_counts()["misses"] == 3
    table.step(second)
    assert table.map.ahead.counts == {
        "mapped_ahead": 2, "used_ahead": 2, "undone_ahead": 0,
    }  # fmt: skip
    np.testing.assert_array_equal(table.whole(), table.reference)


@pytest.mark.backend_independent
def test_a_refused_mapping_made_ahead_changes_nothing():
    slot_map = DenseSlots("ids", VOCAB, CACHE)
    slot_map.ahead.map(np.array([1, 2]))
    before = slot_map.slot_of_id.copy(), slot_map.id_of_slot.copy()
    with pytest.raises(ValueError, match=r"Layer 'ids'.*out of range.*\[0, 40\)"):
        slot_map.ahead.map(np.array([3, VOCAB]))
    with pytest.raises(RuntimeError, match=r"Layer 'ids'.*cache_rows=8"):
        slot_map.ahead.map(np.arange(10, 19))
    np.testing.assert_array_equal(slot_map.slot_of_id, before[0])
    np.testing.assert_array_equal(slot_map.id_of_slot, before[1])
    assert len(slot_map.ahead) == 1


# ------------------------------------------------------------ end to end
def _model(cache_rows, seed=0):
    keras.utils.set_random_seed(seed)
    layer = ks.AllToAllDenseEmbedding(
        500, 4, combiner="sum", optimizer="adagrad", cache_rows=cache_rows,
        store="host", name="ids",
    )  # fmt: skip
    inputs = keras.Input((6,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
    model.compile("sgd", "mse")
    return model, layer


def _data(n=768):
    rng = np.random.default_rng(1)
    x = (rng.zipf(1.2, size=(n, 6)) % 500).astype("int64")
    return x, rng.normal(size=(n, 1)).astype("float32")


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def test_the_stage_maps_a_cached_table_ahead_and_trains_exactly():
    x, y = _data()
    plain, plain_layer = _model(150)
    plain.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    staged, layer = _model(150)
    with ks.data.prefetch((x, y), staged, batch_size=32, shuffle=False) as stage:
        staged.fit(stage, epochs=2, verbose=0)
    stats = layer.stats()
    assert stats["used_ahead"] == stats["mapped_ahead"] == 48
    assert stats["undone_ahead"] == 0
    assert stats["write_backs"] > 100  # the cache was under pressure
    for a, b in zip(layer.get_weights(), plain_layer.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_weights(staged), _weights(plain)):
        np.testing.assert_array_equal(a, b)

    def without_ahead(stats):
        return {k: v for k, v in stats.items() if "ahead" not in k}

    assert without_ahead(stats) == without_ahead(plain_layer.stats())


def test_batches_mapped_ahead_but_not_trained_are_undone():
    """A stage pass cut short (``steps_per_epoch``) leaves mappings of
    batches Keras fetched but did not train; saves, predictions and the
    next training step see the table as trained."""
    x, y = _data()
    plain, plain_layer = _model(150)
    plain.fit(x[:128], y[:128], batch_size=32, verbose=0, shuffle=False)
    staged, layer = _model(150)
    with ks.data.prefetch((x, y), staged, batch_size=32, shuffle=False) as stage:
        staged.fit(stage, steps_per_epoch=4, verbose=0)
        # Keras may fetch past the 4 steps; map a stray batch to be sure.
        layer.row_cache.map_ahead(x[-32:])
        for a, b in zip(layer.get_weights(), plain_layer.get_weights()):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        staged.predict(x[-32:], verbose=0), plain.predict(x[-32:], verbose=0)
    )
    assert layer.stats()["size"] == plain_layer.stats()["size"]
    staged.fit(x[128:192], y[128:192], batch_size=32, verbose=0, shuffle=False)
    plain.fit(x[128:192], y[128:192], batch_size=32, verbose=0, shuffle=False)
    for a, b in zip(layer.get_weights(), plain_layer.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert layer.stats()["undone_ahead"] >= 1


def test_the_stage_raises_a_bad_id_before_the_step():
    x, y = _data(128)
    x[40, 2] = 500
    model, layer = _model(150)
    with ks.data.prefetch((x, y), model, batch_size=32, shuffle=False) as stage:
        with pytest.raises(Exception, match=r"Layer 'ids'.*id 500 is out of range"):
            model.fit(stage, verbose=0)
    # Keras trained the first batch or none (TensorFlow's fit pulls batches
    # ahead of its steps), never the bad one: the table is as trained.
    steps = int(np.asarray(layer.get_weights()[-1]))
    assert steps in (0, 1)
    plain, plain_layer = _model(150)
    if steps:
        plain.fit(x[:32], y[:32], batch_size=32, verbose=0, shuffle=False)
    for a, b in zip(layer.get_weights(), plain_layer.get_weights()):
        np.testing.assert_array_equal(a, b)


class _SaveAt(keras.callbacks.Callback):
    """The cached layer's whole table after batch ``at`` of the first
    epoch, as a checkpoint taken then would hold it."""

    def __init__(self, at):
        super().__init__()
        self.at, self.saved = at, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at and self.saved is None:
            self.saved = self.model.get_layer("ids").get_weights()


def test_a_checkpoint_mid_epoch_sees_the_trained_table_and_keeps_the_look_ahead():
    x, y = _data()
    plain, plain_layer = _model(150)
    plain.fit(x[:192], y[:192], batch_size=32, verbose=0, shuffle=False)
    staged, layer = _model(150)
    save = _SaveAt(5)
    with ks.data.prefetch((x, y), staged, batch_size=32, shuffle=False) as stage:
        staged.fit(stage, verbose=0, callbacks=[save])
    for a, b in zip(save.saved, plain_layer.get_weights()):
        np.testing.assert_array_equal(a, b)
    stats = layer.stats()
    assert stats["used_ahead"] == stats["mapped_ahead"] == 24
    assert stats["undone_ahead"] == 0


def _collection(cache_rows):
    from tests import cached_tables

    keras.utils.set_random_seed(4)
    cache = {"cache_rows": cache_rows, "store": "host"} if cache_rows else {}
    model, layer = cached_tables.build("collection", "adagrad", cache)
    model.compile("sgd", "mse")
    return model, layer


def test_the_stage_maps_a_collections_cached_table_ahead_and_trains_exactly():
    from tests import cached_tables

    x, y = cached_tables.data(16, 24)
    plain, plain_layer = _collection(40)
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    staged, layer = _collection(40)
    # Batches copied to the device in the workers: the ids mapped ahead are
    # read before the copy.
    with ks.data.prefetch(
        (x, y), staged, batch_size=16, shuffle=False, transfer=True
    ) as stage:
        staged.fit(stage, epochs=2, verbose=0)
    stats = layer.stats("a")
    assert stats["used_ahead"] == stats["mapped_ahead"] == 48
    assert stats["undone_ahead"] == 0 and stats["write_backs"] > 100
    assert plain_layer.stats("a")["mapped_ahead"] == 0
    got, want = (
        cached_tables.state("collection", layer),
        cached_tables.state("collection", plain_layer),
    )
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for a, b in zip(_weights(staged), _weights(plain)):
        np.testing.assert_array_equal(a, b)
