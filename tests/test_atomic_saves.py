"""Saves of models holding keras_sparse layers, and every file the library
writes, replace their target whole or not at all (`keras_sparse.atomic_files`).

The reference is the good file written before: after a killed or failing
save it must still be there byte for byte and load to the same weights.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import keras_sparse as ks
from keras_sparse import atomic_files
from keras_sparse.layers.dense_embedding import Embedding
from keras_sparse.ops import native_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(fill):
    ids = keras.Input((2,), dtype="int32")
    layer = ks.layers.AllToAllDenseEmbedding(10, 3, combiner="sum", name="emb")
    model = keras.Model(ids, layer(ids))
    layer.set_weights([np.full((10, 3), fill, "float32")])
    return model


def _table(model):
    return np.asarray(model.get_layer("emb").get_weights()[0])


@pytest.fixture
def published(monkeypatch):
    """The targets `atomic_files.publish` renamed a temporary file over."""
    targets = []
    real = atomic_files.publish

    def spy(temp, target):
        # Written inside the target's folder: the rename stays on one
        # filesystem.
        folder = os.path.dirname(target)
        assert os.path.commonpath([temp, target]) == folder
        targets.append(target)
        real(temp, target)

    monkeypatch.setattr(atomic_files, "publish", spy)
    return targets


_CHILD = """
import os, sys, time
import keras, numpy as np
import keras_sparse as ks
from keras_sparse.layers.dense_embedding import Embedding

target, marker = sys.argv[1:]
ids = keras.Input((2,), dtype="int32")
layer = ks.layers.AllToAllDenseEmbedding(10, 3, combiner="sum", name="emb")
model = keras.Model(ids, layer(ids))
layer.set_weights([np.full((10, 3), 7.0, "float32")])
original = Embedding.save_own_variables

def save_then_hang(self, store):
    # Part of the archive is written when the parent kills this process.
    original(self, store)
    open(marker, "w").close()
    time.sleep(120)

Embedding.save_own_variables = save_then_hang
model.save(target)
"""


def test_a_save_killed_midway_leaves_the_old_file(tmp_path):
    target = str(tmp_path / "m.keras")
    marker = str(tmp_path / "writing")
    _model(1.0).save(target)
    with open(target, "rb") as f:
        good = f.read()
    env = {**os.environ, "PYTHONPATH": ROOT}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), target, marker],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    with open(target, "rb") as f:
        assert f.read() == good
    np.testing.assert_array_equal(_table(keras.saving.load_model(target)), 1.0)
    # Only the target and the killed save's hidden temporary file remain.
    others = sorted(set(os.listdir(tmp_path)) - {"m.keras", "writing"})
    assert all(n.startswith(".m.keras.") and ".tmp" in n for n in others), others


class _Interrupted(BaseException):
    pass


@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"])
def test_a_failing_save_keeps_the_old_file_and_no_temporary(
    tmp_path, monkeypatch, name
):
    target = str(tmp_path / name)
    model = _model(1.0)
    save = model.save if name.endswith(".keras") else model.save_weights
    save(target)
    with open(target, "rb") as f:
        good = f.read()

    def interrupted(self, store):
        raise _Interrupted

    monkeypatch.setattr(Embedding, "save_own_variables", interrupted)
    with pytest.raises(_Interrupted):
        save(target)
    assert os.listdir(tmp_path) == [name]
    with open(target, "rb") as f:
        assert f.read() == good


@pytest.mark.parametrize("weights_only", [False, True])
def test_model_checkpoint_replaces_its_file(tmp_path, published, weights_only):
    name = "ckpt.weights.h5" if weights_only else "ckpt.keras"
    target = str(tmp_path / name)
    with open(target, "w") as f:
        f.write("an older file")
    inode = os.stat(target).st_ino
    model = _model(1.0)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.arange(8).reshape(4, 2) % 10
    y = np.ones((4, 3), "float32")
    checkpoint = keras.callbacks.ModelCheckpoint(target, save_weights_only=weights_only)
    model.fit(x, y, epochs=1, batch_size=4, verbose=0, callbacks=[checkpoint])
    assert published == [target]
    # A new file renamed over the old one, not the old one rewritten.
    assert os.stat(target).st_ino != inode
    assert os.listdir(tmp_path) == [name]
    restored = _model(0.0)
    if weights_only:
        restored.load_weights(target)
    else:
        restored = keras.saving.load_model(target)
    np.testing.assert_array_equal(_table(restored), _table(model))


def test_saves_keep_mode_and_symlinks(tmp_path):
    real = tmp_path / "real.keras"
    link = tmp_path / "link.keras"
    real.write_bytes(b"old")
    os.chmod(real, 0o640)
    link.symlink_to(real)
    _model(3.0).save(str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert oct(os.stat(real).st_mode & 0o777) == oct(0o640)
    np.testing.assert_array_equal(_table(keras.saving.load_model(str(real))), 3.0)
    # A new file gets the mode `open` gives (0o666 less the umask).
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    _model(3.0).save(str(tmp_path / "new.keras"))
    assert os.stat(tmp_path / "new.keras").st_mode == os.stat(plain).st_mode


def test_other_models_and_file_objects_go_to_keras_untouched(tmp_path, published):
    import io

    from keras.src.saving import saving_lib

    _model(1.0)  # the wrap is installed
    ids = keras.Input((2,))
    plain = keras.Model(ids, keras.layers.Dense(3)(ids))
    plain.save(str(tmp_path / "plain.keras"))
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    buffer = io.BytesIO()
    saving_lib.save_model(_model(2.0), buffer)
    assert published == []
    buffer.seek(0)
    np.testing.assert_array_equal(_table(saving_lib.load_model(buffer)), 2.0)


@pytest.mark.backend_independent
def test_the_compiled_helpers_cache_is_published_atomically(
    tmp_path, monkeypatch, published
):
    monkeypatch.setenv("KERAS_SPARSE_CACHE", str(tmp_path / "cache"))
    # A "compiler" that copies its source to the -o output.
    monkeypatch.setenv("KS_TEST_CC", 'sh -c \'cp "$0" "$2"\'')
    loaded, status = native_build.build_library(
        "probe",
        lambda: {"probe.c": "int probe;\n"},
        "probe.c",
        "KS_TEST_CC",
        "cc",
        (),
        lambda path: path.read_text(),
    )
    assert loaded == "int probe;\n", status
    (target,) = published
    assert status == f"on: {target}"
    assert os.listdir(tmp_path / "cache") == [os.path.basename(target)]
