"""Progress bars over long exports, imports, saves and loads of hash tables.

Bars never change results (the chunked steps run in chunks either way),
show only when asked for or in an interactive session, and a failing
import_ still leaves the table as it was.
"""

import re
import sys
import types

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import progress
from keras_sparse.layers.hash import serving_map
from keras_sparse.table import TableFullError

DIM = 4
CAPACITY = 8192
KEYS = 3000
CHUNK = 256  # several chunks per chunked step


@pytest.fixture(autouse=True)
def _default_setting():
    yield
    ks.set_progress()


def _layer(name, capacity=CAPACITY, eviction="lru"):
    layer = ks.DistributedHashEmbedding(
        DIM, capacity=capacity, optimizer="adagrad", eviction=eviction, name=name
    )
    layer.build()
    return layer


def _records(seed=0, n=KEYS):
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, size=n, replace=False).astype("int64")
    return {
        "keys": keys,
        "values": rng.normal(size=(n, DIM)).astype("float32"),
        "slots": {"accumulator": rng.uniform(0.1, 1, (n, DIM)).astype("float32")},
        "scores": rng.integers(0, 100, n).astype("int64"),
    }


def _round_trip():
    """Every record path on one table: what each step leaves behind."""
    source = _layer("source")
    out = {"stored": source.import_(**_records())}
    out["export"] = source.export(include_rows=True)
    store = {}
    source.save_own_variables(store)
    same = _layer("same")
    same.load_own_variables(store)
    out["same"] = same.export(include_rows=True)
    # Another capacity: keys are re-placed hottest first, in chunks.
    other = _layer("other", capacity=CAPACITY + 512)
    other.load_own_variables(store)
    out["other"] = other.export(include_rows=True)
    at_rows = _layer("at_rows")
    rec = out["export"]
    slots = {"accumulator": rec["accumulator"]}
    at_rows.import_(rec["keys"], rec["values"], slots, rec["scores"], rec["rows"])
    out["at_rows"] = at_rows.export(include_rows=True)
    serving_map.refresh_all(source)
    out["map"] = {
        v.name: keras.ops.convert_to_numpy(v.value)
        for v in (source.serving_key_words, source.serving_rows)
    }
    return out


def _assert_same(got, want, path=""):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for name in want:
            _assert_same(got[name], want[name], f"{path}/{name}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=path)


def test_forced_bars_show_and_change_nothing(capsys, monkeypatch):
    ks.set_progress(False)
    quiet = _round_trip()
    assert capsys.readouterr().out == ""

    monkeypatch.setattr(progress, "CHUNK_ROWS", CHUNK)
    ks.set_progress(True, min_rows=1000)
    shown = _round_trip()
    out = capsys.readouterr().out
    _assert_same(shown, quiet)
    n = f"{len(quiet['export']['keys']):,}"
    for title in (
        f"Layer 'source': importing {KEYS:,} keys",
        f"Layer 'source': exporting {n} keys",
        f"Layer 'source': saving {n} keys",
        f"Layer 'same': loading {n} keys",
        f"Layer 'other': loading {n} keys",
        f"Layer 'at_rows': importing {n} keys",
        f"Layer 'source': building the serving map of {n} keys",
    ):
        assert title in out
    # Each bar (after its title) ends full, on a line of its own.
    parts = re.split(r"(?m)^(Layer '.*keys)\n", out)
    assert parts[0] == "" and len(parts) == 2 * 10 + 1
    for title, bar in zip(parts[1::2], parts[2::2]):
        m = title.rsplit(" ", 2)[1].replace(",", "")
        assert f"{m}/{m}" in bar and bar.endswith("\n"), title


def test_no_bar_below_the_threshold(capsys):
    ks.set_progress(True, min_rows=KEYS + 1)
    layer = _layer("small")
    layer.import_(**_records())
    layer.export()
    assert capsys.readouterr().out == ""


def test_auto_mode_is_silent_when_not_interactive(capsys):
    ks.set_progress(None, min_rows=1)
    assert not progress.shown(KEYS)  # pytest's captured stdout: no terminal
    _round_trip()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Layer '" not in captured.err


def test_auto_mode_shows_in_a_terminal_or_a_notebook(monkeypatch):
    ks.set_progress(None, min_rows=10)
    monkeypatch.setitem(sys.modules, "IPython", None)
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: True))
    assert progress.shown(10) and not progress.shown(9)
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: False))
    assert not progress.shown(10)
    kernel = types.SimpleNamespace(kernel=object())
    fake = types.SimpleNamespace(get_ipython=lambda: kernel)
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert progress.shown(10)
    ks.set_progress(False, min_rows=10)
    assert not progress.shown(10)


def _model(layer):
    keys = keras.Input((2,), dtype="int64", name="keys")
    model = keras.Model(keys, layer(keys))
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def test_model_save_load_and_export_show_bars(capsys, tmp_path):
    ks.set_progress(True, min_rows=100)
    layer = ks.DistributedHashEmbedding(
        DIM, capacity=CAPACITY, combiner="sum", optimizer="adagrad", name="user"
    )
    model = _model(layer)
    layer.import_(**_records(n=500))
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    _assert_same(loaded.layers[-1].export(), layer.export())
    out = capsys.readouterr().out
    assert "Layer 'user': saving 500 keys" in out
    assert "Layer 'user': loading 500 keys" in out
    if keras.backend.backend() in ("jax", "tensorflow"):
        model.export(tmp_path / "served", format="tf_saved_model", verbose=False)
        out = capsys.readouterr().out
        assert "Layer 'user': building the serving map of 500 keys" in out


def test_compiled_inference_refreshes_without_a_bar(capsys):
    ks.set_progress(True, min_rows=1)
    layer = _layer("served")
    layer.import_(**_records(n=100))
    capsys.readouterr()
    # predict's refresh
    assert serving_map.refresh_all(layer, show_progress=False) == ["served"]
    assert capsys.readouterr().out == ""


def _state(layer):
    out = layer.export(include_rows=True)
    out["embeddings"] = keras.ops.convert_to_numpy(layer.embeddings.value)
    for name, slot in layer.slots.items():
        out[f"slot {name}"] = keras.ops.convert_to_numpy(slot.value)
    out["version"] = np.asarray(layer.table.version)
    return out


def _failing_imports():
    """Arguments of import_ calls that must fail, each with its error."""
    rec = _records(seed=1)
    bad_values = rec["values"].copy()
    bad_values[-1, 0] = np.nan
    rows = np.arange(KEYS)  # distinct, in range, mostly outside the buckets
    return [
        (ValueError, dict(rec, values=bad_values)),
        (ValueError, dict(rec, rows=rows)),
        (TableFullError, _records(seed=2, n=CAPACITY)),
    ]


def test_failed_import_leaves_the_table_unchanged(capsys, monkeypatch):
    monkeypatch.setattr(progress, "CHUNK_ROWS", CHUNK)
    ks.set_progress(True, min_rows=1)
    layer = _layer("kept", eviction=None)
    layer.import_(**_records(seed=3, n=KEYS // 2))
    before = _state(layer)
    for error, kwargs in _failing_imports():
        with pytest.raises(error):
            layer.import_(**kwargs)
        after = _state(layer)
        after["version"] = before["version"]  # a refused import_ may bump it
        _assert_same(after, before)
        # The bar stops where the error struck and ends its line.
        out = capsys.readouterr().out
        assert "importing" in out and out.endswith("\n")


def test_set_progress_checks_its_arguments():
    with pytest.raises(ValueError, match="enabled"):
        ks.set_progress("yes")
    with pytest.raises(ValueError, match="min_rows"):
        ks.set_progress(True, min_rows=-1)
