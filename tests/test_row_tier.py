"""A hash layer over a row store trains as a table holding every key.

The reference is the same layer with a capacity no key is ever evicted
from; the layer under test has a small table (a cache) whose evicted keys
go down to a `keras_sparse.store` and come back with their vector, slots
and score. Both train through ``model.fit`` (a compiled step on JAX and
TensorFlow, eager on PyTorch) on the same batches; every key's record
(values, slots, score) must match.
"""

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from tests import row_store_models as shared

UNIVERSE = 250
STEPS = 60
BATCH, FIELDS = shared.BATCH, shared.FIELDS


def _batches(seed, universe=UNIVERSE):
    return shared.batches(seed, universe, STEPS)


_model = shared.model
_records = shared.records


@pytest.mark.parametrize(
    "eviction, optimizer, admit_after, universe",
    # With admission, few enough keys that the keys waiting for it never
    # outnumber the small table's count slots (one per row, as many as the
    # reference's would need).
    [("lru", "adagrad", 1, UNIVERSE), ("lfu", "adam", 2, 80), ("lru", "ftrl", 1, 120)],
)
def test_store_matches_a_table_holding_every_key(
    eviction, optimizer, admit_after, universe
):
    keys, target = _batches(0, universe)
    full, full_layer = _model(4096, None, eviction, optimizer, admit_after)
    cached, layer = _model(64, "host", eviction, optimizer, admit_after)
    for model in (full, cached):
        model.fit(keys, target, batch_size=BATCH, shuffle=False, verbose=0)
    stats = layer.stats()
    assert stats["evictions"] >= 5 and stats["fills"] >= 1, stats
    assert full_layer.stats()["evictions"] == 0
    want, got = _records(full_layer), _records(layer)
    np.testing.assert_array_equal(got["keys"], want["keys"])
    for name in want:
        if name in ("keys", "scores"):
            continue
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["scores"], want["scores"])
    assert stats["store_size"] + stats["size"] == len(want["keys"])
    np.testing.assert_allclose(
        cached.predict(keys[:16], verbose=0), full.predict(keys[:16], verbose=0),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_store_survives_save_and_load(tmp_path, kind):
    keys, target = _batches(1)
    spec = ks.store.Host() if kind == "host" else ks.store.Disk(tmp_path / "rows")
    cached, layer = _model(64, spec, "lru", "adagrad", 1)
    half = STEPS // 2 * BATCH
    cached.fit(keys[:half], target[:half], batch_size=BATCH, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    cached.save(path)
    before = _records(layer)
    assert layer.stats()["store_size"] > 0
    loaded = keras.models.load_model(path)
    again = loaded.get_layer("ids")
    assert again.row_tier is not None
    after = _records(again)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    # Both go on training identically.
    for model in (cached, loaded):
        model.fit(
            keys[half:], target[half:], batch_size=BATCH, shuffle=False, verbose=0
        )
    a, b = _records(layer), _records(again)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_store_refuses_what_it_cannot_keep_exact():
    with pytest.raises(ValueError, match="store"):
        DistributedHashEmbedding(4, capacity=64, store="nowhere", name="x")
    layer = DistributedHashEmbedding(
        4,
        capacity=64,
        store="host",
        embeddings_initializer=keras.initializers.Orthogonal(seed=1),
        name="orth",
    )
    with pytest.raises(ValueError, match="per key"):
        layer.build((None, 2))


def test_padding_is_not_read_from_the_store():
    keys, target = _batches(3)
    model, layer = _model(64, "host", "lru", "adagrad", 1)
    model.fit(keys, target, batch_size=BATCH, shuffle=False, verbose=0)
    # Keys without a row (the raw store also keeps stale copies of keys
    # the table holds).
    records = layer.export(include_rows=True)
    stored = records["keys"][records["rows"] == -1][:4]
    assert len(stored) == 4
    batch = np.stack([stored, stored], axis=1)
    weights = np.array([[1.0, 0.0]] * 4, "float32")  # the second column pads
    before = layer.stats()["store_hits"]
    out = layer(batch, weights=weights, training=False)
    assert layer.stats()["store_hits"] - before == 4
    # A stored key's vector is read from the store, padding adds nothing.
    alone = layer(batch[:, :1], training=False)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(alone), atol=1e-6
    )


def test_a_table_with_a_store_is_not_shared():
    _, a = _model(64, "host", "lru", "adagrad", 1)
    b = DistributedHashEmbedding(4, capacity=64, optimizer="adagrad", name="b")
    with pytest.raises(ValueError, match="cannot share"):
        b.table = a.table  # b would evict a's keys with nowhere to put them
    c = DistributedHashEmbedding(4, capacity=64, optimizer="adagrad", name="c")
    d = DistributedHashEmbedding(4, capacity=64, store="host", name="d")
    with pytest.raises(ValueError, match="cannot share"):
        d.table = c.table  # c's calls would evict d's keys
    assert d.table is not c.table  # nothing changed


def test_a_failing_store_says_to_restore_from_a_checkpoint():
    keys, target = _batches(5)
    model, layer = _model(64, "host", "lru", "adagrad", 1)
    model.fit(keys[:64], target[:64], batch_size=BATCH, shuffle=False, verbose=0)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    layer.row_tier.store.write = full_disk
    # The first step that evicts a key fails (compiled steps wrap the error).
    with pytest.raises(Exception, match="restore the model from a checkpoint"):
        model.fit(keys[64:], target[64:], batch_size=BATCH, shuffle=False, verbose=0)


def test_a_key_filled_from_the_store_keeps_a_stale_copy_no_reader_sees():
    # A fill leaves the key's stored row in place (no erase on the step's
    # path); the table's row wins until the key's write-back overwrites it.
    keys, target = _batches(0)
    full, full_layer = _model(4096, None, "lru", "adagrad", 1)
    cached, layer = _model(64, "host", "lru", "adagrad", 1)
    for model in (full, cached):
        model.fit(keys, target, batch_size=BATCH, shuffle=False, verbose=0)
    store = layer.row_tier.store
    raw = np.concatenate([k for k, _ in store.chunks()])
    table_keys = keras.ops.convert_to_numpy(layer.table.export()[0])
    both = np.intersect1d(raw, table_keys)
    assert both.size >= 1  # keys in the table and in the store
    want = _records(full_layer)
    at = np.searchsorted(want["keys"], both)
    _, stale = store.read(both)
    # Their stored copies are older than the trained rows...
    assert not np.allclose(stale["values"], want["values"][at], atol=1e-6)
    # ...and no reader takes them: exports list each key once, with the
    # trained row; the store size leaves them out; read-only calls agree.
    records = layer.export(include_rows=True)
    assert np.unique(records["keys"]).size == records["keys"].size
    got = _records(layer)
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_allclose(got["values"], want["values"], rtol=1e-5, atol=1e-6)
    assert layer.stats()["store_size"] == raw.size - both.size
    probe = np.repeat(both[:, None], FIELDS, axis=1)
    np.testing.assert_allclose(
        cached.predict(probe, verbose=0), full.predict(probe, verbose=0),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    # A key without a row: its stored copy is its trained row.
    gone = np.setdiff1d(raw, table_keys)
    found, rows = store.read(gone)
    assert found.all()
    at = np.searchsorted(want["keys"], gone)
    np.testing.assert_allclose(rows["values"], want["values"][at], rtol=1e-5, atol=1e-6)
