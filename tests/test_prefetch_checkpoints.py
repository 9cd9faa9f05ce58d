"""Checkpoints taken during a fit fed by keras_sparse.data.prefetch.

The stage maps batches into the hash tables ahead of their steps; a save
in the middle of the fit must still equal the save the same run without
the stage makes at that step, key by key, and resume to the same end.
"""

import io
import os
import time
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse.data import prefetch

N, BATCH, EPOCHS = 192, 24, 2
STEPS = N // BATCH  # per epoch


def _model():
    """Hash layer under eviction and admission, a hash field of a
    collection (LFU) and a fixed-vocabulary layer."""
    keras.utils.set_random_seed(11)
    a = keras.Input((3,), dtype="int32", name="a")
    b = keras.Input((2,), dtype="int32", name="b")
    c = keras.Input((2,), dtype="int32", name="c")
    ea = ks.DistributedHashEmbedding(
        4, capacity=64, combiner="sum", optimizer="adagrad", admit_after=2,
        eviction="lru", name="ea",
    )(a)  # fmt: skip
    field = ks.DistributedHashEmbedding(
        4, capacity=64, combiner="mean", optimizer="adam", eviction="lfu",
        name="eb",
    )  # fmt: skip
    eb = ks.HashEmbeddingCollection({"b": field}, name="fields")({"b": b})["b"]
    ec = ks.AllToAllDenseEmbedding(
        50, 4, combiner="sum", optimizer="adagrad", name="ec"
    )(c)
    h = keras.layers.Concatenate()([ea, eb, ec])
    model = keras.Model({"a": a, "b": b, "c": c}, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _data():
    rng = np.random.default_rng(5)
    x = {
        "a": rng.integers(0, 150, (N, 3)).astype(np.int32),  # 150 keys, 64 rows
        "b": rng.integers(0, 200, (N, 2)).astype(np.int32),
        "c": rng.integers(0, 50, (N, 2)).astype(np.int32),
    }
    return x, rng.normal(size=(N, 1)).astype(np.float32)


class _Ahead(keras.callbacks.Callback):
    """Notes whether, after step 3, the stage had mapped batches 4 and 5
    into layer "ea"'s table (else a save could not show what this file
    checks)."""

    stage = None
    seen = False

    def on_train_batch_end(self, batch, logs=None):
        if batch != 2:
            return
        p = self.stage._engine._pass
        lane = next(p.lane[i] for i, f in enumerate(p.e.feeds) if f.layer.name == "ea")
        deadline = time.time() + 10  # the workers map the next batches
        while time.time() < deadline and p.turn[lane] < 5:
            time.sleep(0.01)
        self.seen = p.turn[lane] >= 5


def _fit(folder, staged, extra=()):
    """Fits with a weights-only checkpoint every 3 steps and a .keras one
    every 5 (both cross the epoch boundary); returns the model."""
    x, y = _data()
    model = _model()
    callbacks = [
        *extra,
        keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "w-{epoch}-{batch}.weights.h5"),
            save_freq=3,
            save_weights_only=True,
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "m-{epoch}-{batch}.keras"), save_freq=5
        ),
    ]
    if staged:
        with prefetch((x, y), model, batch_size=BATCH, threads=2, capacity=4) as st:
            for callback in extra:
                callback.stage = st
            model.fit(st, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    else:
        model.fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
            callbacks=callbacks,
        )  # fmt: skip
    return model


def _entries(path):
    """Every array of a checkpoint, by its path in the file."""
    if path.endswith(".keras"):
        with zipfile.ZipFile(path) as z:
            f = h5py.File(io.BytesIO(z.read("model.weights.h5")), "r")
    else:
        f = h5py.File(path, "r")
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            out[name] = np.array(obj)

    with f:
        f.visititems(visit)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plain = tmp_path_factory.mktemp("plain")
    staged = tmp_path_factory.mktemp("staged")
    ref = _fit(str(plain), staged=False)
    ahead = _Ahead()
    _fit(str(staged), staged=True, extra=[ahead])
    assert ahead.seen  # the look-ahead had mapped batches not yet trained
    return plain, staged, ref


def test_mid_fit_checkpoints_equal_the_unstaged_run_key_by_key(runs):
    plain, staged, _ = runs
    names = sorted(os.listdir(plain))
    assert names == sorted(os.listdir(staged))
    assert len(names) == 5 + 3  # every 3 and every 5 of 16 steps
    keys_seen = 0
    for name in names:
        want, got = _entries(str(plain / name)), _entries(str(staged / name))
        assert sorted(want) == sorted(got), name
        for entry in want:  # records, rows, slots, scores, clock, sketch
            np.testing.assert_array_equal(
                want[entry], got[entry], err_msg=f"{name}: {entry}"
            )
        records = [k for k in want if k.endswith("record_keys")]
        assert len(records) == 2  # both hash layers saved their records
        keys_seen += sum(len(want[k]) for k in records)
    assert keys_seen > 0


def _hash_layer(model, name):
    return (
        model.get_layer("fields").fields["b"] if name == "eb" else model.get_layer(name)
    )


def test_resuming_from_a_mid_fit_checkpoint_ends_like_the_unstaged_run(runs):
    _, staged, ref = runs
    name = "m-2-2.keras"  # after 10 of 16 steps
    x, y = _data()
    epoch, batch = (int(v) for v in name.split(".")[0].split("-")[1:])
    done = (epoch - 1) * STEPS + batch  # steps the checkpoint holds
    model = _model()
    model.load_weights(str(staged / name))
    # The rest of the reference run's batches, in its order.
    order = np.concatenate([np.arange(N)] * EPOCHS)[done * BATCH :]
    rest = {k: v[order] for k, v in x.items()}
    model.fit(rest, y[order], batch_size=BATCH, shuffle=False, verbose=0)
    for layer in ("ea", "eb"):
        want = _hash_layer(ref, layer).export()
        got = _hash_layer(model, layer).export()
        for k in want:
            np.testing.assert_array_equal(want[k], got[k], err_msg=f"{layer} {k}")
    for w, v in zip(ref.weights, model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(w), keras.ops.convert_to_numpy(v), w.path
        )
