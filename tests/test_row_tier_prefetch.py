"""A hash layer over a row store, trained through `keras_sparse.data.prefetch`.

The stage maps batches into the table ahead of their steps; the row moves
each call plans run in its batch's step. Training through the stage must
equal training without it and a table holding every key, key by key; a
save in the middle of the fit must equal the unstaged run's at that step;
batches mapped but never trained (an abandoned pass) must lose no key; an
inference stage must read the keys the store holds.
"""

import os
import time

import h5py
import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.layers.hash.embedding import DistributedHashEmbedding
from tests import row_store_models as shared

STEPS = 40
BATCH, FIELDS = shared.BATCH, shared.FIELDS


def _batches(seed, universe=250, steps=STEPS):
    return shared.batches(seed, universe, steps)


_model = shared.model
_records = shared.records


def _assert_same(got, want, exact=False):
    np.testing.assert_array_equal(got["keys"], want["keys"])
    np.testing.assert_array_equal(got["scores"], want["scores"])
    for name in want:
        if exact:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:
            np.testing.assert_allclose(
                got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name
            )


def _fit(model, keys, target, stage=None, **kwargs):
    if stage is None:
        model.fit(keys, target, batch_size=BATCH, shuffle=False, verbose=0, **kwargs)
        return None
    with ks.data.prefetch((keys, target), model, batch_size=BATCH, **stage) as st:
        model.fit(st, verbose=0, **kwargs)
    return st


@pytest.mark.parametrize(
    "threads, capacity, eviction, optimizer, admit_after, universe",
    [(1, 2, "lru", "adagrad", 1, 250), (2, 4, "lfu", "adam", 2, 80)],
)
def test_stage_trains_as_without_it_and_as_a_table_holding_every_key(
    threads, capacity, eviction, optimizer, admit_after, universe
):
    keys, target = _batches(0, universe)
    args = (eviction, optimizer, admit_after)
    full, full_layer = _model(4096, None, *args)
    plain, plain_layer = _model(64, "host", *args)
    staged, layer = _model(64, "host", *args)
    _fit(full, keys, target, epochs=2)
    _fit(plain, keys, target, epochs=2)
    stage = {"threads": threads, "capacity": capacity}
    _fit(staged, keys, target, stage, epochs=2)
    stats = layer.stats()
    assert stats["evictions"] >= 5 and stats["fills"] >= 1, stats
    assert layer.row_tier.pending() == 0
    got = _records(layer)
    _assert_same(got, _records(plain_layer), exact=True)
    _assert_same(got, _records(full_layer))


class _SaveAt(keras.callbacks.Callback):
    """Saves the weights after given steps; with a stage, first waits until
    it has mapped batches ahead (else the save would check nothing)."""

    def __init__(self, folder, steps, layer, staged):
        super().__init__()
        self.folder, self.steps, self.layer, self.staged = folder, steps, layer, staged
        self.ahead = []

    def on_train_batch_end(self, batch, logs=None):
        if batch not in self.steps:
            return
        if self.staged:
            tier = self.layer.row_tier
            deadline = time.time() + 10
            while time.time() < deadline and tier.pending() < 2:
                time.sleep(0.01)
            self.ahead.append(tier.pending())
        self.model.save_weights(os.path.join(self.folder, f"s{batch}.weights.h5"))


def _entries(path):
    out = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = np.array(obj)

        f.visititems(visit)
    return out


def test_mid_fit_saves_equal_the_unstaged_run_at_that_step(tmp_path):
    keys, target = _batches(1)
    steps = (6, 17)
    for staged in (False, True):
        model, layer = _model(64, "host")
        folder = tmp_path / ("staged" if staged else "plain")
        folder.mkdir()
        saver = _SaveAt(str(folder), steps, layer, staged)
        stage = {"threads": 2, "capacity": 4} if staged else None
        _fit(model, keys, target, stage, callbacks=[saver])
    assert min(saver.ahead) >= 2  # the stage had mapped untrained batches
    for step in steps:
        want = _entries(str(tmp_path / "plain" / f"s{step}.weights.h5"))
        got = _entries(str(tmp_path / "staged" / f"s{step}.weights.h5"))
        assert sorted(got) == sorted(want)
        keys_entry = [n for n in want if n.endswith("record_keys")]
        assert len(keys_entry) == 1
        prefix = keys_entry[0][: -len("record_keys")]
        w_order = np.argsort(want[keys_entry[0]])
        g_order = np.argsort(got[keys_entry[0]])
        assert (want[prefix + "record_rows"] < 0).sum() > 0  # store keys saved
        for name in want:
            w, g = want[name], got[name]
            if name.startswith(prefix + "record_"):
                w, g = w[w_order], g[g_order]
            np.testing.assert_array_equal(g, w, err_msg=f"step {step}: {name}")


@pytest.mark.parametrize(
    "eviction, optimizer, admit_after, universe",
    [("lru", "adagrad", 1, 250), ("lfu", "adam", 2, 110)],
)
def test_abandoned_pass_loses_no_key(eviction, optimizer, admit_after, universe):
    keys, target = _batches(2, universe)
    first = 10 * BATCH
    args = (eviction, optimizer, admit_after)
    full, full_layer = _model(4096, None, *args)
    for part in (slice(0, first), slice(first, None)):
        _fit(full, keys[part], target[part])
    model, layer = _model(64, "host", *args)
    # 10 of 40 steps: the stage mapped batches beyond them, never trained.
    stage = _fit(model, keys, target, {"threads": 2, "capacity": 4}, steps_per_epoch=10)
    assert layer.row_tier.pending() == 0
    # A new stage trains on from step 10.
    _fit(model, keys[first:], target[first:], {"threads": 1, "capacity": 2})
    _assert_same(_records(layer), _records(full_layer))
    assert layer.stats()["evictions"] >= 5, layer.stats()
    assert stage.stats()["undone_calls"] >= 1, stage.stats()


def test_inference_stage_reads_the_stored_keys():
    keys, target = _batches(3)
    model, layer = _model(64, "host")
    full, _ = _model(4096, None)
    for m in (model, full):
        _fit(m, keys, target)
    assert layer.stats()["store_size"] > 0
    hits = layer.stats()["store_hits"]
    with ks.data.prefetch(keys, model, batch_size=BATCH, training=False) as st:
        got = model.predict(st, verbose=0)
    staged_hits = layer.stats()["store_hits"] - hits
    want = model.predict(keys, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        got, full.predict(keys, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6
    )
    assert staged_hits > 0


def test_a_store_layer_sharing_its_table_is_refused():
    model, layer = _model(64, "host")
    other = DistributedHashEmbedding(4, capacity=64, name="other")
    # Refused where the table is shared, before any stage sees it.
    with pytest.raises(ValueError, match="cannot share its table"):
        other.table = layer.table
    assert other.table is not layer.table
