"""Row-store rows in model files: streamed through Keras's asset files.

``model.save`` writes a layer's store rows chunk by chunk into the
``.keras`` file's assets (memory bounded by a chunk), ``load_model``
streams them back; files written the older way (rows in the weights) still
load; a save failing midway leaves the old file; `export_chunks` streams
the records out. References: the layer's own `export()` before saving, and
NumPy copies of the store.
"""

import os
import tracemalloc
import zipfile

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers import store_assets
from keras_sparse.store import chunk_files
from tests import row_store_models as shared

STEPS = 12


def _trained(spec, steps=STEPS):
    keys, target = shared.batches(1, 250, steps)
    model, layer = shared.model(64, spec)
    model.fit(keys, target, batch_size=shared.BATCH, shuffle=False, verbose=0)
    assert layer.stats()["store_size"] > 20
    return model, layer


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_save_streams_store_rows_through_assets(tmp_path, kind):
    spec = ks.store.Host() if kind == "host" else ks.store.Disk(tmp_path / "rows")
    model, layer = _trained(spec)
    before = shared.records(layer)
    path = tmp_path / "m.keras"
    model.save(path)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    assert any(n.endswith("store_rows/rows.json") for n in names), names
    weights = shared.weights_entries(path)
    rows = next(v for k, v in weights.items() if k.endswith("record_rows"))
    stored = next(v for k, v in weights.items() if k.endswith("store_rows_in_assets"))
    # The weights hold the table's keys only; the store's are in the assets.
    assert (rows >= 0).all() and int(stored) == layer.stats()["store_size"]
    loaded = keras.saving.load_model(path)
    _assert_same(shared.records(loaded.get_layer("ids")), before)


def test_files_with_store_rows_in_the_weights_still_load(tmp_path, monkeypatch):
    model, layer = _trained("host")
    before = shared.records(layer)
    path = tmp_path / "old.keras"
    with monkeypatch.context() as m:  # the older format: rows in the weights
        m.setattr(store_assets, "expected", lambda: False)
        model.save(path)
    rows = next(
        v for k, v in shared.weights_entries(path).items() if "record_rows" in k
    )
    assert (rows == -1).sum() == layer.stats()["store_size"]
    loaded = keras.saving.load_model(path)
    _assert_same(shared.records(loaded.get_layer("ids")), before)


def test_weights_files_keep_store_rows_and_keras_files_need_load_model(tmp_path):
    model, layer = _trained("host")
    before = shared.records(layer)
    model.save_weights(tmp_path / "m.weights.h5")
    model.save(tmp_path / "m.keras")
    fresh, again = shared.model(64, "host")
    fresh.load_weights(tmp_path / "m.weights.h5")
    _assert_same(shared.records(again), before)
    other, third = shared.model(64, "host")
    third.build()
    empty = shared.records(third)
    with pytest.raises(ValueError, match="asset files.*load_model"):
        other.load_weights(tmp_path / "m.keras")
    _assert_same(shared.records(third), empty)


def test_a_layer_without_a_store_takes_the_saved_rows_into_its_table(tmp_path):
    model, layer = _trained("host")
    before = shared.records(layer)
    model.save(tmp_path / "m.keras")
    _, plain = shared.model(4096, None)
    plain.build()
    with zipfile.ZipFile(tmp_path / "m.keras") as zf:
        zf.extractall(tmp_path / "x")
    weights = shared.weights_entries(tmp_path / "m.keras")
    at = "layers/distributed_hash_embedding"
    entries = {k.split("/")[-1]: v for k, v in weights.items() if k.startswith(at)}
    with store_assets.assets_follow():
        plain.load_own_variables(entries)
        plain.load_assets(str(tmp_path / "x" / "assets" / at))
    after = shared.records(plain)
    np.testing.assert_array_equal(after["keys"], before["keys"])
    for name in ("values", "accumulator", "scores"):
        np.testing.assert_array_equal(after[name], before[name])


def test_save_memory_is_bounded_by_a_chunk(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(store_assets, "CHUNK_BYTES", 64 << 10)
    _, layer = shared.model(64, "host")
    layer.build()
    store = layer.row_tier.store
    n = 40_000
    rng = np.random.default_rng(0)
    keys = rng.permutation(10 * n)[:n].astype(np.int64) * 3 + 1
    rows = {f.name: rng.normal(size=(n, f.width)).astype(f.dtype) for f in store.fields}
    store.write(keys, rows)
    total = sum(r.nbytes for r in rows.values())
    assert total > 1 << 20
    ks.set_progress(True, min_rows=1000)
    try:
        tracemalloc.start()
        with store_assets.assets_follow():
            layer.save_assets(str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        ks.set_progress()
    # A few chunks' worth at most, never the store's size.
    assert peak < 6 * (64 << 10), peak
    assert "saving 40,000 stored rows" in capsys.readouterr().out
    folder = tmp_path / store_assets.FOLDER
    assert chunk_files.read_manifest(folder, "t")["chunks"] > 10
    got_keys, got = [], {f.name: [] for f in store.fields}
    for k, r in chunk_files.read_chunks(folder, store.fields, "t"):
        got_keys.append(np.asarray(k))
        for name in got:
            got[name].append(np.asarray(r[name]))
    order = np.argsort(np.concatenate(got_keys))
    want = np.argsort(keys)
    np.testing.assert_array_equal(np.concatenate(got_keys)[order], keys[want])
    for name in got:
        np.testing.assert_array_equal(
            np.concatenate(got[name])[order], rows[name][want]
        )


def test_a_save_failing_midway_keeps_the_old_file(tmp_path, monkeypatch):
    model, layer = _trained("host")
    path = tmp_path / "m.keras"
    model.save(path)
    good = path.read_bytes()
    before = shared.records(layer)
    model.fit(*shared.batches(2, 250, 5), batch_size=shared.BATCH, verbose=0)
    monkeypatch.setattr(store_assets, "CHUNK_BYTES", 256)
    real, calls = chunk_files._file, []

    def failing(folder, index, name):
        calls.append(index)
        if index == 3:
            raise OSError("no space left on device")
        return real(folder, index, name)

    monkeypatch.setattr(chunk_files, "_file", failing)
    with pytest.raises(OSError, match="no space"):
        model.save(path)
    assert max(calls) == 3
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["m.keras"]
    loaded = keras.saving.load_model(path)
    _assert_same(shared.records(loaded.get_layer("ids")), before)


@pytest.mark.parametrize("spec", ["host", None])
def test_export_chunks_stream_what_export_gives(spec):
    _, layer = _trained(spec) if spec else shared.model(64, None)
    if spec is None:
        layer.build()
        layer.import_(np.arange(40, dtype="int64") * 5, np.ones((40, 4), "f4"))
    for include_rows in (False, True):
        want = layer.export(include_rows=include_rows)
        chunks = list(layer.export_chunks(chunk_rows=7, include_rows=include_rows))
        assert all(len(c["keys"]) <= 7 for c in chunks)
        got = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
        _assert_same(got, want)
    with pytest.raises(ValueError, match="chunk_rows"):
        layer.export_chunks(chunk_rows=0)


def test_dense_cache_saves_its_table_through_assets(tmp_path, monkeypatch):
    monkeypatch.setattr(store_assets, "CHUNK_BYTES", 4096)
    ids = np.random.default_rng(0).integers(0, 3000, (320, 2)).astype("int32")
    target = np.ones((320, 1), "float32")

    def model(path):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((2,), dtype="int32")
        layer = ks.AllToAllDenseEmbedding(
            3000, 4, combiner="sum", optimizer="adagrad", cache_rows=64,
            store=ks.store.Disk(path), name="ids",
        )  # fmt: skip
        out = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)))
        out.compile(optimizer="sgd", loss="mse")
        return out, layer

    cached, layer = model(tmp_path / "rows")
    cached.fit(ids, target, batch_size=8, verbose=0)
    assert layer.stats()["size"] > 0  # rows newer than the store's
    want = layer.get_weights()
    cached.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as zf:
        assert sum(n.endswith(".values.npy") for n in zf.namelist()) > 10
    weights = shared.weights_entries(tmp_path / "m.keras")
    assert not any(np.size(v) >= 3000 for v in weights.values())
    for got in (
        keras.saving.load_model(tmp_path / "m.keras").get_layer("ids"),
        _old_file_loaded(cached, tmp_path, monkeypatch),
    ):
        for a, b in zip(got.get_weights(), want):
            np.testing.assert_array_equal(a, b)
    # The saving layer's store was not replaced by the loads.
    for a, b in zip(layer.get_weights(), want):
        np.testing.assert_array_equal(a, b)


def _old_file_loaded(model, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(store_assets, "expected", lambda: False)
        model.save(tmp_path / "old.keras")
    return keras.saving.load_model(tmp_path / "old.keras").get_layer("ids")


def _files(folder):
    return {
        name: (os.stat(folder / name).st_ino, os.stat(folder / name).st_mtime_ns)
        for name in sorted(os.listdir(folder))
    }


def test_a_disk_store_reopens_in_place(tmp_path):
    folder = tmp_path / "rows"
    model, layer = _trained(ks.store.Disk(folder))
    before = shared.records(layer)
    layer.flush_store()
    assert layer.stats()["size"] == 0
    assert layer.stats()["store_size"] == len(before["keys"])
    _assert_same(shared.records(layer), before)
    # While it is open, a new store never replaces it; nor reopens it.
    with pytest.warns(
        UserWarning, match=r"is open, in this process or another.*ids\.1"
    ):
        _, other = shared.model(64, ks.store.Disk(folder))
    assert other.row_tier.store.path == f"{folder / 'ids'}.1"
    with pytest.raises(ValueError, match="is open already"):
        shared.model(64, ks.store.Disk(folder, reopen=True))
    layer.row_tier.store.close()
    del model, layer
    files = _files(folder / "ids")
    _, again = shared.model(64, ks.store.Disk(folder, reopen=True))
    assert _files(folder / "ids") == files  # opened in place: no copy, no write
    assert again.stats()["store_size"] == len(before["keys"])
    _assert_same(shared.records(again), before)
    again.row_tier.store.close()
    with pytest.raises(ks.store.StoreFormatError, match="reopen=True"):
        shared.model(64, ks.store.Disk(folder, reopen=True), optimizer="adam")


def test_a_dense_disk_store_reopens_in_place(tmp_path):
    folder = tmp_path / "rows"

    def layer(spec):
        out = ks.AllToAllDenseEmbedding(
            500, 3, optimizer="adagrad", cache_rows=64, store=spec, name="ids"
        )
        out.build()
        return out

    first = layer(ks.store.Disk(folder))
    ids = np.random.default_rng(1).integers(0, 500, (40, 2))
    for batch in ids.reshape(10, 4, 2):
        first(batch, training=True)
    want = first.get_weights()
    first.flush_store()
    assert first.stats()["size"] == 0
    first.row_cache.row_tier.store.close()
    files = _files(folder / "ids")
    again = layer(ks.store.Disk(folder, reopen=True))
    assert _files(folder / "ids") == files
    for a, b in zip(again.get_weights()[:-1], want[:-1]):
        np.testing.assert_array_equal(a, b)
